from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SnapshotEntry(_message.Message):
    __slots__ = ("key", "position", "size_bytes", "ttl_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    position: int
    size_bytes: int
    ttl_s: int
    def __init__(self, key: _Optional[str] = ..., position: _Optional[int] = ..., size_bytes: _Optional[int] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("running_seqs", "waiting_seqs", "free_slots", "free_blocks")
    RUNNING_SEQS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SEQS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    running_seqs: int
    waiting_seqs: int
    free_slots: int
    free_blocks: int
    def __init__(self, running_seqs: _Optional[int] = ..., waiting_seqs: _Optional[int] = ..., free_slots: _Optional[int] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("engine_id", "address", "load", "restarted")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    address: str
    load: EngineLoad
    restarted: bool
    def __init__(self, engine_id: _Optional[str] = ..., address: _Optional[str] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., restarted: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ttl_ms", "epoch", "new_lease")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEW_LEASE_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    epoch: int
    new_lease: bool
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., epoch: _Optional[int] = ..., new_lease: _Optional[bool] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("engine_id", "entries")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    entries: _containers.RepeatedCompositeFieldContainer[SnapshotEntry]
    def __init__(self, engine_id: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[SnapshotEntry, _Mapping]]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("published",)
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    published: int
    def __init__(self, published: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class Holder(_message.Message):
    __slots__ = ("engine_id", "address", "position", "size_bytes", "ttl_ms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    address: str
    position: int
    size_bytes: int
    ttl_ms: int
    def __init__(self, engine_id: _Optional[str] = ..., address: _Optional[str] = ..., position: _Optional[int] = ..., size_bytes: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class KeyHolders(_message.Message):
    __slots__ = ("key", "holders")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    key: str
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    def __init__(self, key: _Optional[str] = ..., holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KeyHolders]
    def __init__(self, results: _Optional[_Iterable[_Union[KeyHolders, _Mapping]]] = ...) -> None: ...

class WithdrawRequest(_message.Message):
    __slots__ = ("engine_id", "keys")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class WithdrawResponse(_message.Message):
    __slots__ = ("withdrawn",)
    WITHDRAWN_FIELD_NUMBER: _ClassVar[int]
    withdrawn: int
    def __init__(self, withdrawn: _Optional[int] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine_id", "address", "load", "heartbeat_age_ms", "lease_left_ms", "epoch", "entries")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_LEFT_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    address: str
    load: EngineLoad
    heartbeat_age_ms: int
    lease_left_ms: int
    epoch: int
    entries: int
    def __init__(self, engine_id: _Optional[str] = ..., address: _Optional[str] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., heartbeat_age_ms: _Optional[int] = ..., lease_left_ms: _Optional[int] = ..., epoch: _Optional[int] = ..., entries: _Optional[int] = ...) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ...) -> None: ...
