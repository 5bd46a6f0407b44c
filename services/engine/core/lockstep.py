"""A DeepSeek V4 engine whose model is split over ranks: every rank runs the same Engine in
lockstep (docs/design.md §15).

Each rank holds an Engine over its share of the model (model/deepseek_v4/parallel.py) and
its own ledgers, which stay byte-identical: the rows and entries they keep come from
replicated weights, and every rank makes the same calls in the same order. Rank 0 is the
engine the mesh talks to. `Leader` wraps its Engine: each call that changes engine state
(a request added, aborted or adopted; a step) is sent to the other ranks first, with what
would otherwise differ between them (a new request's id and sampling seed, the clock the
snapshot and handoff stores read), and then made locally; the other ranks `follow`, making
the same calls. A step's model calls then meet in the same collectives on every rank.

Scheduling must be a function of those calls alone. Two decisions read step times: the
step-time budget (`--step-slo-ms`) caps prefill from a fit of them, and the adaptive draft
policy weighs a draft's cost with them. Each step's call carries rank 0's measurements for
both, and every rank decides from those. MTP drafts run on every rank alike (the MTP block is
replicated, its head gathered).
"""

from __future__ import annotations

import datetime
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from kvmesh.services.engine.core.engine import Engine


class _Clock:
    """The time the snapshot and handoff stores read: rank 0's, as of the last call sent."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def _share_clock(engine: Engine) -> _Clock:
    clock = _Clock()
    engine.prefix.store.clock = clock
    engine.handoffs.clock = clock
    return clock


# Calls travel on a gloo group of their own (whatever the model's collectives run on), whose
# timeout an idle engine does not reach: the other ranks wait for the next call as long as
# rank 0 has none. A rank that dies closes its connections, which ends a wait at once.
CHANNEL_TIMEOUT = datetime.timedelta(days=30)


def _channel():
    """Created by Leader and follow at the same point on every rank (new_group is collective)."""
    return dist.new_group(backend="gloo", timeout=CHANNEL_TIMEOUT)


def _broadcast(group, message: tuple) -> None:
    box: list[Any] = [message]
    dist.broadcast_object_list(box, src=0, group=group)


def _receive(group) -> tuple:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Leader:
    """Rank 0's engine: Engine's interface, every state change mirrored to the others.
    Reads (stats, cfg, has_work, ...) are the local engine's."""

    def __init__(self, engine: Engine, on_broken: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self._clock = _share_clock(engine)
        self._group = _channel()
        # what a failed collective (a rank gone) does besides raising: serving, end the
        # process, so its clients see UNAVAILABLE and go elsewhere (services/engine/split.py)
        self._on_broken = on_broken

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    @property
    def hooks(self):
        return self.engine.hooks

    @hooks.setter
    def hooks(self, hooks) -> None:          # the remote tiers attach to rank 0's engine
        self.engine.hooks = hooks

    def _send(self, message: tuple) -> None:
        try:
            _broadcast(self._group, message)
        except RuntimeError as exc:
            self._broken(exc)
            raise

    def _broken(self, exc: BaseException) -> None:
        if self._on_broken is not None:
            self._on_broken(exc)

    def _tick(self) -> float:
        self._clock.now = time.monotonic()
        return self._clock.now

    def add_request(self, prompt_ids: list[int], params, request_id: str = "", salt: str = "",
                    traffic_class: str = "", prefetched=None, resume: int = 0,
                    handoff: bool = False):
        args = (list(prompt_ids), params, request_id or uuid.uuid4().hex, salt, traffic_class,
                prefetched, resume, handoff, random.getrandbits(62))
        now = self._tick()
        req = self.engine.add_request(*args[:8], request_seed=args[8])   # refused: none sent
        self._send(("add", now, args))
        return req

    def abort(self, request_id: str) -> None:
        self._send(("abort", self._tick(), request_id))
        self.engine.abort(request_id)

    def adopt(self, handoff):
        now = self._tick()
        req = self.engine.adopt(handoff)
        self._send(("adopt", now, handoff))
        return req

    def step(self):
        # the step budget's fit and the draft policy's costs: each rank's own step times
        # would differ, and so would what they decide
        self._send(("step", self._tick(), self.engine.step_budget.steps(),
                    self.engine.spec.policy.costs()))
        try:
            return self.engine.step()
        except RuntimeError as exc:          # a collective failed: a rank is gone
            self._broken(exc)
            raise

    def stop(self) -> None:
        """Release the other ranks' `follow` (the engine stops serving)."""
        self._send(("stop", self._tick()))


def follow(engine: Engine, on_events: Callable[[list], None] | None = None) -> None:
    """A rank other than 0: make rank 0's calls on this rank's engine until it stops. Its
    steps' events (the same as rank 0's) go to `on_events`, or nowhere."""
    clock = _share_clock(engine)
    group = _channel()
    while True:
        kind, clock.now, *rest = _receive(group)
        if kind == "step":
            engine.step_budget.follow(rest[0])
            engine.spec.policy.follow(rest[1])
            events = engine.step()
            if on_events is not None:
                on_events(events)
        elif kind == "add":
            engine.add_request(*rest[0][:8], request_seed=rest[0][8])
        elif kind == "abort":
            engine.abort(rest[0])
        elif kind == "adopt":
            engine.adopt(rest[0])
        elif kind == "stop":
            return
        else:
            raise ValueError(f"lockstep: unknown call {kind!r} from rank 0")
