"""Routing: which engine serves a request. Pure logic: no I/O, no clock of its own.

Order of preference (docs/design.md §10):

    1. snapshot  the live engine holding the deepest SWA snapshot of the prompt's
                 prefix (directory Lookup results, passed in as `holders`)
    2. affinity  the engine that last served the longest shared prefix
                 (bounded LRU: snapshot key of a block boundary -> engine address)
    3. load      fewest requests in flight at this gateway + queued at the engine
                 (directory load), ties broken round-robin

A cache-preferred engine (1 or 2) is skipped when it is more than
`max_imbalance` requests busier than the idlest candidate: a cache hit saves at
most one prefill, a queue costs every request in it.

`Router` owns the engine table (`EngineState` objects: in-flight counts, failure
marks, directory leases) and the affinity map; only the gateway core calls its
mutating methods, from one event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class EngineState:
    """One engine as this gateway sees it. Mutated only by `Router`."""

    address: str
    engine_id: str
    static: bool = False          # from --engines: kept even when the directory forgets it
    lease_until: float = 0.0      # directory lease end (monotonic); 0 = not from the directory
    queued: int = 0               # running + waiting, from the directory's last heartbeat
    in_flight: int = 0            # requests this gateway has open on it
    down_until: float = 0.0       # avoid after a failure until then
    unreachable: bool = False     # its address refuses connections (GatewayCore.refresh_engines)
    # identity (GatewayCore.check_identity): (engine_id, model fingerprint) its GetModelInfo
    # first answered; whether it answered so since it last failed; refused: it answered as
    # another engine or model, and gets nothing until the directory registers it again
    identity: tuple[str, str] | None = None
    checked: bool = False
    refused: bool = False

    def live(self, now: float) -> bool:
        return self.static or self.lease_until > now

    @property
    def load(self) -> int:
        return self.in_flight + self.queued


class Choice(NamedTuple):
    engine: EngineState
    reason: str          # "snapshot" | "affinity" | "load"
    cached_tokens: int   # snapshot position when reason == "snapshot", else 0


class Router:
    def __init__(self, static: Iterable[str] = (), affinity_entries: int = 65536,
                 max_imbalance: int = 4):
        self.engines: dict[str, EngineState] = {
            a: EngineState(a, a, static=True) for a in static}
        self.affinity: OrderedDict[str, str] = OrderedDict()
        self.affinity_entries = affinity_entries
        self.max_imbalance = max_imbalance
        self._turn = 0

    # --- engine table -----------------------------------------------------------------
    def update_from_directory(self, engines: Iterable, now: float) -> None:
        """Apply one ListEngines answer (EngineInfo-like: engine_id, address, load, lease_left_ms).

        Engines missing from the answer keep whatever lease they had left, so a
        directory that answers late never revives or kills an engine early.
        """
        for info in engines:
            st = self.engines.get(info.address)
            if st is None:
                st = self.engines[info.address] = EngineState(info.address, info.engine_id)
            if st.identity is not None and info.engine_id and info.engine_id != st.identity[0]:
                # registered again under another name: the identity to check is the new one
                st.identity, st.checked, st.refused = None, False, False
            st.engine_id = info.engine_id or st.engine_id
            st.lease_until = now + info.lease_left_ms / 1000.0
            st.queued = info.load.running_seqs + info.load.waiting_seqs
        for addr in [a for a, st in self.engines.items() if not st.live(now)]:
            if self.engines[addr].in_flight == 0:
                del self.engines[addr]
        for st in self.engines.values():
            if st.static and st.lease_until <= now:
                # a static engine the directory no longer vouches for (it died, or the
                # directory is down): its last reported queue is stale, and kept it would
                # keep the engine from ever being the least loaded again
                st.queued = 0

    def candidates(self, now: float, exclude: Sequence[str] = ()) -> list[EngineState]:
        """Live engines not excluded; those marked down or unreachable only when nothing
        else is left."""
        live = [st for st in self.engines.values()
                if st.live(now) and not st.refused and st.address not in exclude]
        up = [st for st in live if st.down_until <= now and not st.unreachable]
        return up or live

    def mark_down(self, address: str, until: float) -> None:
        st = self.engines.get(address)
        if st is not None:
            st.down_until = until
            st.checked = False        # whoever answers there next proves who it is first

    def mark_up(self, address: str) -> None:
        st = self.engines.get(address)
        if st is not None:
            st.down_until = 0.0

    # --- choice ---------------------------------------------------------------------------
    def pick(self, now: float, keys: Sequence[str] = (),
             holders: Mapping[str, Sequence] | None = None,
             exclude: Sequence[str] = ()) -> Choice | None:
        """Choose an engine; `keys` are the prompt's snapshot keys, shortest prefix first."""
        cands = self.candidates(now, exclude)
        if not cands:
            return None
        by_addr = {st.address: st for st in cands}
        floor = min(st.load for st in cands)
        ok = lambda st: st.load <= floor + self.max_imbalance  # noqa: E731
        if holders:
            best: tuple[int, int, EngineState] | None = None
            for key in keys:
                for h in holders.get(key, ()):
                    st = by_addr.get(h.address)
                    if st is not None and ok(st):
                        rank = (h.position, -st.load, st)
                        if best is None or rank[:2] > best[:2]:
                            best = rank
            if best is not None:
                return Choice(best[2], "snapshot", best[0])
        for key in reversed(keys):
            addr = self.affinity.get(key)
            st = by_addr.get(addr) if addr else None
            if st is not None and ok(st):
                return Choice(st, "affinity", 0)
        least = [st for st in cands if st.load == floor]
        self._turn += 1
        return Choice(least[self._turn % len(least)], "load", 0)

    def remember(self, keys: Sequence[str], address: str) -> None:
        """Record that `address` now holds the prefix blocks named by `keys`."""
        for key in keys:
            self.affinity[key] = address
            self.affinity.move_to_end(key)
        while len(self.affinity) > self.affinity_entries:
            self.affinity.popitem(last=False)
