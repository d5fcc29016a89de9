from core.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_UNSPECIFIED: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
FINISH_UNSPECIFIED: FinishReason
STOP: FinishReason
LENGTH: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "seed")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("trajectory_id", "input_ids", "sampling", "images", "max_stale_versions", "traceparent")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_STALE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    max_stale_versions: int
    traceparent: str
    def __init__(self, trajectory_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ..., max_stale_versions: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("output_ids", "logprobs", "versions", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens", "interruptions", "replica")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    interruptions: int
    replica: str
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., interruptions: _Optional[int] = ..., replica: _Optional[str] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("requests", "timeout_s")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    timeout_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., timeout_s: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateBatchItem(_message.Message):
    __slots__ = ("index", "response", "code", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    response: GenerateResponse
    code: int
    error: str
    def __init__(self, index: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class GenerateBatchResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GenerateBatchItem]
    def __init__(self, items: _Optional[_Iterable[_Union[GenerateBatchItem, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("output_ids", "logprobs", "versions", "finish_reason", "prompt_tokens", "cached_tokens")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "path", "safetensors", "shm")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    version: int
    path: str
    safetensors: bytes
    shm: str
    def __init__(self, version: _Optional[int] = ..., path: _Optional[str] = ..., safetensors: _Optional[bytes] = ..., shm: _Optional[str] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("version", "name", "dtype", "shape", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, version: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "load_ms", "interrupted_requests")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    load_ms: float
    interrupted_requests: int
    def __init__(self, version: _Optional[int] = ..., load_ms: _Optional[float] = ..., interrupted_requests: _Optional[int] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetVersionResponse(_message.Message):
    __slots__ = ("version", "model")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    version: int
    model: str
    def __init__(self, version: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...
