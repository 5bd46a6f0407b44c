"""Finish: how a generation ended (the engine's events carry it; the gRPC service and the
gateway name it as common.v1 FinishReason)."""

from __future__ import annotations

import enum


class Finish(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORTED = "aborted"
    HANDOFF = "handoff"     # prefill done and first token sent: a decode engine continues
