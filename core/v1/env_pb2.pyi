from core.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateSessionRequest(_message.Message):
    __slots__ = ("env_id", "options", "seed", "lease_ttl_s", "client_id", "request_id")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    options: _containers.ScalarMap[str, str]
    seed: int
    lease_ttl_s: float
    client_id: str
    request_id: str
    def __init__(self, env_id: _Optional[str] = ..., options: _Optional[_Mapping[str, str]] = ..., seed: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., client_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id", "run_id", "lease_expires_unix_ms", "action_space")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ACTION_SPACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    run_id: str
    lease_expires_unix_ms: int
    action_space: str
    def __init__(self, session_id: _Optional[str] = ..., run_id: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., action_space: _Optional[str] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id", "run_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    run_id: str
    def __init__(self, session_id: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("session_id", "seed", "options", "run_id")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seed: int
    options: _containers.ScalarMap[str, str]
    run_id: str
    def __init__(self, session_id: _Optional[str] = ..., seed: _Optional[int] = ..., options: _Optional[_Mapping[str, str]] = ..., run_id: _Optional[str] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("text", "images", "step", "width", "height", "instruction")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    text: str
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    step: int
    width: int
    height: int
    instruction: str
    def __init__(self, text: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ..., step: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., instruction: _Optional[str] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("type", "point", "end_point", "content", "key", "direction", "target", "raw")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    POINT_FIELD_NUMBER: _ClassVar[int]
    END_POINT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    type: str
    point: _containers.RepeatedScalarFieldContainer[float]
    end_point: _containers.RepeatedScalarFieldContainer[float]
    content: str
    key: str
    direction: str
    target: str
    raw: str
    def __init__(self, type: _Optional[str] = ..., point: _Optional[_Iterable[float]] = ..., end_point: _Optional[_Iterable[float]] = ..., content: _Optional[str] = ..., key: _Optional[str] = ..., direction: _Optional[str] = ..., target: _Optional[str] = ..., raw: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "action", "run_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: Action
    run_id: str
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[_Union[Action, _Mapping]] = ..., run_id: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "outcome", "info_json", "lease_expires_unix_ms", "step_ms")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    observation: Observation
    reward: float
    outcome: _common_pb2.Outcome
    info_json: str
    lease_expires_unix_ms: int
    step_ms: float
    def __init__(self, observation: _Optional[_Union[Observation, _Mapping]] = ..., reward: _Optional[float] = ..., outcome: _Optional[_Union[_common_pb2.Outcome, str]] = ..., info_json: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., step_ms: _Optional[float] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_ids", "lease_ttl_s")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_ttl_s: float
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("alive", "unknown", "run_id")
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    alive: _containers.RepeatedScalarFieldContainer[str]
    unknown: _containers.RepeatedScalarFieldContainer[str]
    run_id: str
    def __init__(self, alive: _Optional[_Iterable[str]] = ..., unknown: _Optional[_Iterable[str]] = ..., run_id: _Optional[str] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("state", "env_id")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    env_id: str
    def __init__(self, state: _Optional[bytes] = ..., env_id: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("env_id", "state", "lease_ttl_s", "request_id")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    state: bytes
    lease_ttl_s: float
    request_id: str
    def __init__(self, env_id: _Optional[str] = ..., state: _Optional[bytes] = ..., lease_ttl_s: _Optional[float] = ..., request_id: _Optional[str] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("session_id", "run_id", "request_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    run_id: str
    request_id: str
    def __init__(self, session_id: _Optional[str] = ..., run_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ListEnvsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvsResponse(_message.Message):
    __slots__ = ("env_ids",)
    ENV_IDS_FIELD_NUMBER: _ClassVar[int]
    env_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, env_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("payload", "run_id")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    run_id: str
    def __init__(self, payload: _Optional[bytes] = ..., run_id: _Optional[str] = ...) -> None: ...
