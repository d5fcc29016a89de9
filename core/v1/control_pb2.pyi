from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("role", "policy_version", "run_id", "uptime_s", "metrics_json", "pid")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    role: str
    policy_version: int
    run_id: str
    uptime_s: float
    metrics_json: str
    pid: int
    def __init__(self, role: _Optional[str] = ..., policy_version: _Optional[int] = ..., run_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., metrics_json: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class CommandRequest(_message.Message):
    __slots__ = ("name", "args")
    class ArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    args: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., args: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CommandResponse(_message.Message):
    __slots__ = ("ok", "message", "result_json")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    result_json: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ..., result_json: _Optional[str] = ...) -> None: ...
