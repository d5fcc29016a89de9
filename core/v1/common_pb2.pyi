from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    RUNNING: _ClassVar[Outcome]
    TERMINATED: _ClassVar[Outcome]
    TRUNCATED: _ClassVar[Outcome]
    INFRA_ERROR: _ClassVar[Outcome]
OUTCOME_UNSPECIFIED: Outcome
RUNNING: Outcome
TERMINATED: Outcome
TRUNCATED: Outcome
INFRA_ERROR: Outcome

class Image(_message.Message):
    __slots__ = ("data", "mime", "sha256", "width", "height")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime: str
    sha256: str
    width: int
    height: int
    def __init__(self, data: _Optional[bytes] = ..., mime: _Optional[str] = ..., sha256: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...
