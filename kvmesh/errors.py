"""Domain errors shared by every service.

Cores raise these; the gRPC layer (`kvmesh.rpc`) maps them to status codes, so
no domain module imports grpc.
"""


class KvmeshError(Exception):
    """Base class: the message is shown to the caller as is. `param`: the request field
    it is about (the OpenAI API's error `param`), None when it is about none."""

    def __init__(self, *args, param: str | None = None):
        super().__init__(*args)
        self.param = param


class InvalidArgument(KvmeshError, ValueError):
    """The request is malformed; the message says which field and how to fix it."""


class NotFound(KvmeshError, KeyError):
    """A named thing (engine, object, snapshot) does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ResourceExhausted(KvmeshError):
    """A size or capacity limit was hit (prompt too long, batch too large)."""


class TooLarge(ResourceExhausted):
    """A size limit on the request itself (bytes or tokens): HTTP 413, where other
    RESOURCE_EXHAUSTED (capacity) is 429. Still RESOURCE_EXHAUSTED over gRPC."""


class Unavailable(KvmeshError):
    """A dependency is down or overloaded; retrying later may succeed."""
