"""kvmesh/grpc_logs.py: grpc's "reply to a departed caller" record becomes one INFO line
without a traceback; every other record of grpc's logger passes as it was."""

from __future__ import annotations

import logging

import pytest

from kvmesh import grpc_logs


@pytest.fixture
def grpc_logger(caplog):
    logger = logging.getLogger(grpc_logs.GRPC_LOGGER)
    saved = list(logger.filters)
    grpc_logs.install()
    grpc_logs.install()                                  # once per process, however called
    assert sum(isinstance(f, grpc_logs.DepartedCallerFilter) for f in logger.filters) == 1
    caplog.set_level(logging.DEBUG, logger=grpc_logs.GRPC_LOGGER)
    yield logger
    logger.filters[:] = saved


def _raise_and_log(logger, message: str, *args) -> None:
    try:
        raise RuntimeError('Failed "execute_batch": (SendInitialMetadataOperation, ...)')
    except RuntimeError:
        logger.exception(message, *args)      # as grpc's asyncio server logs it: ERROR + traceback


def test_departed_caller_is_one_info_line(grpc_logger, caplog):
    _raise_and_log(grpc_logger, "ExecuteBatchError raised in core by servicer method [%s]",
                   "/kvmesh.directory.v1.DirectoryService/Lookup")
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.exc_info is None
    assert record.getMessage() == ("reply not sent: the caller of "
                                   "[/kvmesh.directory.v1.DirectoryService/Lookup] had already "
                                   "gone (cancelled)")
    assert "Traceback" not in caplog.text


def test_other_grpc_errors_keep_their_level_and_traceback(grpc_logger, caplog):
    _raise_and_log(grpc_logger, "Unexpected [%s] raised by servicer method [%s]",
                   "KeyError", "/kvmesh.directory.v1.DirectoryService/Lookup")
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert "Traceback" in caplog.text
