from kvmesh.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling", "max_tokens", "stop_token_ids", "stop", "cache_salt", "ignore_eos", "traffic_class", "resume_generated", "handoff", "handoff_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    RESUME_GENERATED_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    cache_salt: str
    ignore_eos: bool
    traffic_class: _common_pb2.TrafficClass
    resume_generated: int
    handoff: bool
    handoff_from: HandoffSource
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., cache_salt: _Optional[str] = ..., ignore_eos: _Optional[bool] = ..., traffic_class: _Optional[_Union[_common_pb2.TrafficClass, str]] = ..., resume_generated: _Optional[int] = ..., handoff: _Optional[bool] = ..., handoff_from: _Optional[_Union[HandoffSource, _Mapping]] = ...) -> None: ...

class HandoffSource(_message.Message):
    __slots__ = ("address", "request_id", "total_bytes", "sha256", "block_hashes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    address: str
    request_id: str
    total_bytes: int
    sha256: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, address: _Optional[str] = ..., request_id: _Optional[str] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class HandoffInfo(_message.Message):
    __slots__ = ("state_bytes", "total_bytes", "blocks", "sha256", "block_hashes")
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    state_bytes: int
    total_bytes: int
    blocks: int
    sha256: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, state_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., sha256: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "handoff", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    handoff: HandoffInfo
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., handoff: _Optional[_Union[HandoffInfo, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("tag", "generate", "cancel")
    TAG_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    tag: int
    generate: GenerateRequest
    cancel: bool
    def __init__(self, tag: _Optional[int] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("tag", "event", "error")
    TAG_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tag: int
    event: GenerateResponse
    error: SessionError
    def __init__(self, tag: _Optional[int] = ..., event: _Optional[_Union[GenerateResponse, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("counters",)
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, float]
    def __init__(self, counters: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("preset", "model_config_json", "model_fingerprint", "layout_fingerprint", "block_size", "tokenizer", "max_seq_len", "engine_id")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    preset: str
    model_config_json: str
    model_fingerprint: str
    layout_fingerprint: str
    block_size: int
    tokenizer: str
    max_seq_len: int
    engine_id: str
    def __init__(self, preset: _Optional[str] = ..., model_config_json: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., tokenizer: _Optional[str] = ..., max_seq_len: _Optional[int] = ..., engine_id: _Optional[str] = ...) -> None: ...

class FetchSwaSnapshotRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class FetchSwaSnapshotResponse(_message.Message):
    __slots__ = ("position", "layout_fingerprint", "model_fingerprint", "total_bytes", "data", "sha256")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    position: int
    layout_fingerprint: str
    model_fingerprint: str
    total_bytes: int
    data: bytes
    sha256: str
    def __init__(self, position: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class FetchHandoffRequest(_message.Message):
    __slots__ = ("request_id", "skip")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    skip: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., skip: _Optional[_Iterable[bytes]] = ...) -> None: ...

class HandoffHeader(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "request", "seed", "num_computed", "enc_lo", "dec_lo", "cmp_from", "block_hashes", "block_sizes", "state_bytes", "total_bytes", "layout_fingerprint", "model_fingerprint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    ENC_LO_FIELD_NUMBER: _ClassVar[int]
    DEC_LO_FIELD_NUMBER: _ClassVar[int]
    CMP_FROM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    request: GenerateRequest
    seed: int
    num_computed: int
    enc_lo: int
    dec_lo: int
    cmp_from: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_sizes: _containers.RepeatedScalarFieldContainer[int]
    state_bytes: int
    total_bytes: int
    layout_fingerprint: str
    model_fingerprint: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., seed: _Optional[int] = ..., num_computed: _Optional[int] = ..., enc_lo: _Optional[int] = ..., dec_lo: _Optional[int] = ..., cmp_from: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_sizes: _Optional[_Iterable[int]] = ..., state_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class FetchHandoffResponse(_message.Message):
    __slots__ = ("header", "data", "sha256")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    header: HandoffHeader
    data: bytes
    sha256: str
    def __init__(self, header: _Optional[_Union[HandoffHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...
