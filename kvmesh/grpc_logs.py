"""A reply to a caller that has already gone is logged as what it is, not as a crash.

When a unary handler returns after its caller cancelled (a client's stream cancelled
mid-flight takes the gateway's directory Lookup with it), gRPC core refuses the batch that
would send the reply, and grpcio's asyncio server logs that refusal as
"ExecuteBatchError raised in core by servicer method [...]" at ERROR with a traceback from
inside grpc (grpc/grpc#32551 made it a log line instead of an unretrieved task exception).
Nothing in the service failed and nothing is lost: the reply had no one to go to. The
filter below turns exactly those records into one INFO line naming the method, so a
traceback in a service log keeps meaning a bug (tests/gateway/test_hostile_clients.py
checks service logs for tracebacks after a cancel storm). Every other grpc record passes
untouched.
"""

from __future__ import annotations

import logging

GRPC_LOGGER = "grpc._cython.cygrpc"
_MARK = "ExecuteBatchError raised in core by servicer method"


class DepartedCallerFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text.startswith(_MARK):
            method = text[len(_MARK):].strip()
            record.msg = "reply not sent: the caller of %s had already gone (cancelled)"
            record.args = (method,)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


def install() -> None:
    """Adds the filter to grpc's asyncio server logger, once per process."""
    logger = logging.getLogger(GRPC_LOGGER)
    if not any(isinstance(f, DepartedCallerFilter) for f in logger.filters):
        logger.addFilter(DepartedCallerFilter())
