from kvmesh.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ObjectHeader(_message.Message):
    __slots__ = ("key", "size", "traffic_class")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    traffic_class: _common_pb2.TrafficClass
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., traffic_class: _Optional[_Union[_common_pb2.TrafficClass, str]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ObjectHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[ObjectHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class GetHeader(_message.Message):
    __slots__ = ("index", "found", "size")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    index: int
    found: bool
    size: int
    def __init__(self, index: _Optional[int] = ..., found: _Optional[bool] = ..., size: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: GetHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[GetHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_length",)
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    def __init__(self, prefix_length: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClassUsage(_message.Message):
    __slots__ = ("traffic_class", "objects", "bytes")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    traffic_class: _common_pb2.TrafficClass
    objects: int
    bytes: int
    def __init__(self, traffic_class: _Optional[_Union[_common_pb2.TrafficClass, str]] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class LocationStatus(_message.Message):
    __slots__ = ("index", "location", "up")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    index: int
    location: str
    up: bool
    def __init__(self, index: _Optional[int] = ..., location: _Optional[str] = ..., up: _Optional[bool] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("objects", "bytes", "pending", "classes", "mem_objects", "mem_bytes", "mem_capacity", "disk_objects", "disk_bytes", "disk_capacity", "capacity_bytes", "high_watermark", "low_watermark", "locations", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    MEM_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    MEM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DISK_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    LOW_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    objects: int
    bytes: int
    pending: int
    classes: _containers.RepeatedCompositeFieldContainer[ClassUsage]
    mem_objects: int
    mem_bytes: int
    mem_capacity: int
    disk_objects: int
    disk_bytes: int
    disk_capacity: int
    capacity_bytes: int
    high_watermark: float
    low_watermark: float
    locations: _containers.RepeatedCompositeFieldContainer[LocationStatus]
    counters: _containers.ScalarMap[str, int]
    def __init__(self, objects: _Optional[int] = ..., bytes: _Optional[int] = ..., pending: _Optional[int] = ..., classes: _Optional[_Iterable[_Union[ClassUsage, _Mapping]]] = ..., mem_objects: _Optional[int] = ..., mem_bytes: _Optional[int] = ..., mem_capacity: _Optional[int] = ..., disk_objects: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_capacity: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., high_watermark: _Optional[float] = ..., low_watermark: _Optional[float] = ..., locations: _Optional[_Iterable[_Union[LocationStatus, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("page_token", "page_size")
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    page_token: str
    page_size: int
    def __init__(self, page_token: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class ObjectInfo(_message.Message):
    __slots__ = ("key", "size", "traffic_class", "created_unix", "last_access_unix", "complete")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_UNIX_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    traffic_class: _common_pb2.TrafficClass
    created_unix: float
    last_access_unix: float
    complete: bool
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., traffic_class: _Optional[_Union[_common_pb2.TrafficClass, str]] = ..., created_unix: _Optional[float] = ..., last_access_unix: _Optional[float] = ..., complete: _Optional[bool] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("objects", "next_page_token")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    next_page_token: str
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("phase", "done", "total")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    phase: str
    done: int
    total: int
    def __init__(self, phase: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class RunGCRequest(_message.Message):
    __slots__ = ("dry_run",)
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    def __init__(self, dry_run: _Optional[bool] = ...) -> None: ...

class GcReport(_message.Message):
    __slots__ = ("dry_run", "expired", "evicted", "stale", "orphans", "skipped_busy", "bytes_freed", "bytes_before")
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    ORPHANS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BUSY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    BYTES_BEFORE_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    expired: _containers.RepeatedScalarFieldContainer[str]
    evicted: _containers.RepeatedScalarFieldContainer[str]
    stale: _containers.RepeatedScalarFieldContainer[str]
    orphans: _containers.RepeatedScalarFieldContainer[str]
    skipped_busy: _containers.RepeatedScalarFieldContainer[str]
    bytes_freed: int
    bytes_before: int
    def __init__(self, dry_run: _Optional[bool] = ..., expired: _Optional[_Iterable[str]] = ..., evicted: _Optional[_Iterable[str]] = ..., stale: _Optional[_Iterable[str]] = ..., orphans: _Optional[_Iterable[str]] = ..., skipped_busy: _Optional[_Iterable[str]] = ..., bytes_freed: _Optional[int] = ..., bytes_before: _Optional[int] = ...) -> None: ...

class RunGCResponse(_message.Message):
    __slots__ = ("progress", "report")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    progress: Progress
    report: GcReport
    def __init__(self, progress: _Optional[_Union[Progress, _Mapping]] = ..., report: _Optional[_Union[GcReport, _Mapping]] = ...) -> None: ...

class ScrubRequest(_message.Message):
    __slots__ = ("repair",)
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    repair: bool
    def __init__(self, repair: _Optional[bool] = ...) -> None: ...

class ScrubReport(_message.Message):
    __slots__ = ("repair", "objects", "healthy", "degraded", "lost", "shards_bad", "shards_repaired")
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    SHARDS_BAD_FIELD_NUMBER: _ClassVar[int]
    SHARDS_REPAIRED_FIELD_NUMBER: _ClassVar[int]
    repair: bool
    objects: int
    healthy: int
    degraded: _containers.RepeatedScalarFieldContainer[str]
    lost: _containers.RepeatedScalarFieldContainer[str]
    shards_bad: int
    shards_repaired: int
    def __init__(self, repair: _Optional[bool] = ..., objects: _Optional[int] = ..., healthy: _Optional[int] = ..., degraded: _Optional[_Iterable[str]] = ..., lost: _Optional[_Iterable[str]] = ..., shards_bad: _Optional[int] = ..., shards_repaired: _Optional[int] = ...) -> None: ...

class ScrubResponse(_message.Message):
    __slots__ = ("progress", "report")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    progress: Progress
    report: ScrubReport
    def __init__(self, progress: _Optional[_Union[Progress, _Mapping]] = ..., report: _Optional[_Union[ScrubReport, _Mapping]] = ...) -> None: ...

class ReindexRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReindexReport(_message.Message):
    __slots__ = ("objects", "runs", "blocks_found", "restored", "unreadable")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FOUND_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    UNREADABLE_FIELD_NUMBER: _ClassVar[int]
    objects: int
    runs: int
    blocks_found: int
    restored: int
    unreadable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, objects: _Optional[int] = ..., runs: _Optional[int] = ..., blocks_found: _Optional[int] = ..., restored: _Optional[int] = ..., unreadable: _Optional[_Iterable[str]] = ...) -> None: ...

class ReindexResponse(_message.Message):
    __slots__ = ("progress", "report")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    progress: Progress
    report: ReindexReport
    def __init__(self, progress: _Optional[_Union[Progress, _Mapping]] = ..., report: _Optional[_Union[ReindexReport, _Mapping]] = ...) -> None: ...
