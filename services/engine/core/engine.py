"""Engine: the engine core serving a DeepSeek V4 or V4.1 checkpoint.

add_request / step / abort / has_work / stats / counters / cfg / tokenizer / prefix: what
AsyncEngine, the gRPC service and `kvmesh generate --local` call; `build.build_core` builds it
over the model the checkpoint's model_type names. Underneath it is the
model package's ledger path (services/engine/model/deepseek_v4/ledgers.py): every token's
state lives in the engine's state slots and blocks, and one step is one `ledgers.step` over
all running sequences (decode rows first, then prefill chunks, within the token budget).

Owners, all on the engine thread: Engine owns `requests`, `outputs`, `waiting`,
`running`, `counters` and every Request's fields; the Ledgers own slots and blocks;
PrefixReuse owns the snapshot store.

Admission is by worst case: a request is admitted only when a slot is free and the blocks
its whole generation can need (prompt + max_tokens) are free beside what running requests
may still take, so a running request never waits for a block and nothing is preempted.

With --kvstore, completed blocks are written through (hooks.block_done) and a prompt's
missing blocks come back from it; with --directory, stored snapshots are published and a
peer's is fetched (rpc/remote.py, unchanged: it only enqueues and prefetches).

--speculative ngram:K drafts by prompt lookup (core/speculative.py): a
decode row carries its drafts, verification keeps a prefix of them, and the rows of the
rejected ones are taken back (ledgers.rollback, at most 6) before any block is registered.

--role prefill / decode hand a request from a prefill engine (rings of 396 rows with
--extra-state) to a decode engine after its first token (core/ledger_handoff.py).

--speculative mtp:K drafts from the checkpoint's MTP module (core/mtp_draft.py; V4's
`mtp.*`, or kvmesh's own `kvmesh.mtp.*` on V4.1), fed the trunk's last streams of every
committed position.

Prefill truncation (--truncation mask | compact) runs on V4.1 checkpoints (core/model_paths.py);
a DeepSeek V4 checkpoint refuses it at start-up, naming the flag.
"""

from __future__ import annotations

import random
import time
import uuid
import weakref
from collections import Counter, deque

import torch

from kvmesh.errors import InvalidArgument, Unavailable
from kvmesh.generation import check_traffic_class
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core import ledger_handoff
from kvmesh.services.engine.core.events import COUNTERS, Event, Hooks
from kvmesh.services.engine.core.finish import Finish
from kvmesh.services.engine.core.handoff_store import Handoff, HandoffStore, handoff_problem
from kvmesh.services.engine.core.model_paths import model_path
from kvmesh.services.engine.core.mtp_draft import MtpDrafter
from kvmesh.services.engine.core.output import OutputState
from kvmesh.services.engine.core.prefix_reuse import Match, PrefixReuse
from kvmesh.services.engine.core.request import Request, ServedModel
from kvmesh.services.engine.core.request_checks import check_prompt
from kvmesh.services.engine.core.sampling import (
    SamplingParams,
    attach_logprobs,
    draw_batch,
    penalize,
    read_ids,
)
from kvmesh.services.engine.core.speculative import Speculator, engine_setting
from kvmesh.services.engine.core.step_budget import StepBudget
from kvmesh.services.engine.core.step_plan import plan
from kvmesh.services.engine.model.deepseek_v4 import layout, ledgers
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.services.engine.model.deepseek_v4.ledgers import BLOCK
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model


class Engine:
    def __init__(self, model: V4Model | V41Model, ecfg: EngineConfig, tokenizer, name: str):
        self.path = model_path(model, ecfg)   # V4 or V4.1: ledgers, forward, replay, cut
        self.model, self.ecfg, self.tokenizer = model, ecfg, tokenizer
        self.cfg = ServedModel(name, model.whole)   # a split rank's model.cfg has its heads only
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids, model only "
                             f"{model.cfg.vocab_size}")
        self.ledgers = self.path.ledgers
        self.prefix = PrefixReuse(self.ledgers, self.cfg.fingerprint(), self.path.period,
                                  ecfg.snapshot_bytes, ecfg.snapshot_ttl_min, self.path.snapshots)
        self.hooks = Hooks()
        # through a weak proxy: callbacks holding the engine made a cycle
        me = weakref.proxy(self)
        self.prefix.store.on_put = lambda snap: me._snapshot_stored(snap)
        self.prefix.store.on_evict = lambda key: me.hooks.snapshot_evicted(key)
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, OutputState] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters: Counter = Counter(dict.fromkeys(COUNTERS, 0))
        self.prefill_token_s = 0.0
        # prefill tokens a step beside decodes may carry (--step-slo-ms); off when
        # deterministic: timing-sized chunks would change fp32 results between runs
        self.step_budget = StepBudget(0.0 if ecfg.deterministic else ecfg.step_slo_ms)
        # speculative decoding: ngram:K, K <= the 6 tokens a slot can take back
        module = self.path.mtp() if ecfg.speculative.startswith("mtp") else None
        setting = engine_setting(ecfg.speculative, layout.BACKTRACK, module is not None)
        drafter = MtpDrafter(module, model.cfg.window) if module is not None else None
        self.spec = Speculator(setting, ecfg.ngram_min, ecfg.ngram_max, drafter,
                               adaptive=ecfg.spec_policy == "adaptive" and not ecfg.deterministic)
        # handoffs waiting for a decode engine to fetch them (prefill engines)
        self.handoffs = HandoffStore(ecfg.snapshot_bytes, ttl_s=60.0)

    # --- requests ----------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "",
                    salt: str = "", traffic_class: str = "", prefetched=None, resume: int = 0,
                    handoff: bool = False, request_seed: int | None = None) -> Request:
        """Check and queue a request (InvalidArgument naming the field). `prefetched`: the
        kvstore's blocks and a peer's snapshot for it (rpc/remote.py). request_seed: an
        unseeded request's (core/lockstep.py)."""
        n_prompt = check_prompt(prompt_ids, params, resume, self.cfg.vocab_size,
                                self.cfg.max_seq_len)
        check_traffic_class(traffic_class)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidArgument(f"request_id {request_id!r} is already running")
        seed = params.seed if params.seed is not None else request_seed
        seed = random.getrandbits(62) if seed is None else seed
        req = Request(request_id, list(prompt_ids[:n_prompt]), params, seed, salt,
                      traffic_class, handoff, output=list(prompt_ids[n_prompt:]),
                      prefetched=prefetched,
                      # hashed for the prefetch from these very ids and salt: the chain's start
                      chain=list(prefetched.hashes) if prefetched else [])
        if req.max_blocks() > self.ecfg.num_blocks:
            raise InvalidArgument(f"prompt + max_tokens need {req.max_blocks()} cache blocks, "
                                  f"this engine has {self.ecfg.num_blocks} x {BLOCK} tokens")
        out = OutputState(params, self.tokenizer.eos_id, self.tokenizer.stream())
        out.resume(req.output)            # raises InvalidArgument if they already finished
        self.spec.add(request_id, params)    # InvalidArgument naming `speculative`
        self.requests[request_id] = req
        self.outputs[request_id] = out
        self.waiting.append(req)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(prompt_ids)
        return req

    def _snapshot_stored(self, snap) -> None:
        self.counters["snapshot_stores"] += 1
        self.hooks.snapshot_stored(snap.key, snap)

    # --- what the remote tiers ask (rpc/remote.py) -------------------------------------
    @property
    def snapshot_size(self) -> int:
        return self.prefix.snapshot_bytes

    def local_view(self, prompt_ids: list[int], salt: str):
        return self.prefix.local_view([], prompt_ids, salt, self.path.cut(len(prompt_ids)))

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and req.finish is None:
            self._release(req, Finish.ABORTED)
            self.counters["aborted"] += 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ------------------------------------------------------------------
    def step(self) -> list[Event]:
        t_step = time.perf_counter()
        self._admit()
        logits: dict[str, torch.Tensor] = {}
        replaying = [r for r in self.running if r.replay is not None]
        for req in replaying:
            row = self._replay(req)
            if row is not None:           # else it stopped at its snapshot: prefill goes on
                logits[req.request_id] = row
        drafts = self.spec.propose([r for r in self.running if r.request_id not in logits])
        works = plan([r for r in self.running if r.request_id not in logits], drafts,
                     self.ecfg, self.step_budget)
        # the step's shape, for the speculation policy's cost model (a replay is other work)
        n_decode = sum(1 for r, _ in works if r.pending == 1)
        n_drafted = sum(len(ids) - 1 for r, ids in works if r.pending == 1)
        n_drafting = sum(1 for r, ids in works if r.pending == 1 and len(ids) > 1)
        other = len(replaying) + sum(len(ids) for r, ids in works if r.pending != 1)
        verifying: list[tuple[Request, list[int], torch.Tensor, tuple]] = []
        if works:
            ends = [r.seq.length + len(ids) for r, ids in works]
            outs, streams = self._forward(works)
            for (req, ids), out, end, h in zip(works, outs, ends, streams, strict=True):
                self.counters["computed_tokens"] += len(ids)
                start = end - len(h)         # the rows past a V4.1 truncation cut, if any
                if len(ids) > 1 and req.request_id in drafts:     # committed once judged
                    verifying.append((req, ids[1:], out, (start, h)))
                    continue
                self._after(req)
                self.spec.observe(req, req, (start, h), req.seq.length)     # MTP drafter
                if req.pending == 0:
                    logits[req.request_id] = out[-1]
        self.counters["steps"] += 1
        if self.counters["steps"] % 256 == 0:
            self.prefix.store.expire()
        # one host read for every sampled id and every verdict (sampling.read_ids)
        ready = [r for r in self.running if r.request_id in logits]
        parts, where = draw_batch([(penalize(logits[r.request_id], r.params, r.prompt, r.output),
                                    r.params, len(r.output), r.seed) for r in ready])
        read = read_ids(parts + [self.spec.judge(r, out, d) for r, d, out, _ in verifying])
        events = [self._emit(req, [read[part][at]]) for req, (part, at) in
                  zip(ready, where, strict=True)]
        attach_logprobs(events, [logits[r.request_id] for r in ready],
                        [r.params.logprobs for r in ready])
        for (req, d, _, hidden), verdict in zip(verifying, read[len(parts):], strict=True):
            events.append(self._verified(req, d, verdict, hidden))
        seconds = time.perf_counter() - t_step
        self.spec.step_done(n_decode, n_drafted, other, seconds, n_drafting)
        if not replaying:      # a replay is work the step-time fit does not model
            self.step_budget.observe(n_decode + n_drafted, other, seconds)
        return events

    def _forward(self, works: list[tuple[Request, list[int]]]):
        """One ledger step over the works: each one's logits, and its last layer's streams
        (what the MTP drafter reads; past a cut only). A prompt chunk carries its request's
        decoder cut (V4.1 truncation), a decode row none."""
        back = self.path.lookback          # tokens before a chunk the model reads (Engram)
        return self.path.forward([(r.seq, ids) for r, ids in works],
                                 [r.cut if r.pending > 1 else None for r, _ in works],
                                 [r.recent(back) for r, _ in works] if back else None)

    def _verified(self, req: Request, drafts: list[int], verdict: list[int],
                  hidden: tuple) -> Event:
        """Emit what verification kept (accepted drafts, then one more token); the rows of
        rejected drafts are taken back before any block is registered, and only the kept
        rows' streams reach the MTP drafter."""
        tokens = self.spec.settle(req, drafts, verdict)
        rejected = len(drafts) - (len(tokens) - 1)
        event = self._emit(req, tokens)
        if event.finish is None:
            ledgers.rollback(self.ledgers, req.seq, req.seq.length - rejected)
            self._after(req)
            self.spec.observe(req, req, hidden, req.seq.length)
        return event

    def _admit(self) -> None:
        """Waiting requests in order, while a slot and their worst-case blocks are free."""
        pool = self.ledgers.pool
        while self.waiting and len(self.running) < self.ecfg.max_running \
                and self.ledgers.free_slots:
            req = self.waiting[0]
            refused = self.prefix.refused
            req.cut = self.path.cut(len(req.tokens))
            match = self.prefix.match(req.chain, req.tokens, req.salt, req.prefetched,
                                      limit=req.cut)
            self.counters["remote_blocks_refused"] += self.prefix.refused - refused
            revived = sum(1 for b in match.blocks if pool.ref_cnt[b] == 0)
            owed = sum(r.max_blocks() - len(r.seq.blocks) for r in self.running)
            if req.max_blocks() - len(match.blocks) > pool.num_free - revived - owed:
                return
            self.waiting.popleft()
            req.prefetched = None
            req.seq = self.ledgers.open()
            self.prefix.start(req.seq, match)
            req.registered = match.tokens // BLOCK
            req.cached_tokens = match.tokens
            # (a V4.1 hit stops at the decoder's cut: so does the snapshot it would restore)
            at = self.prefix.snapshot_position(len(req.tokens) if req.cut is None else req.cut + 1)
            req.snapshot_at = at if at is not None and at > match.tokens else None
            if match.replay:
                req.replay = match
            self._count_hit(match)
            req.scheduled_s = time.monotonic()
            self.running.append(req)

    def _count_hit(self, match: Match) -> None:
        if not match.tokens:
            return
        c = self.counters
        c["cache_hit_tokens"] += match.tokens
        c["block_hits_local"] += len(match.blocks)
        c["block_hits_remote"] += len(match.fetched)
        if match.replay:
            c["snapshot_misses"] += 1
            c["replayed_tokens"] += BLOCK
        else:
            c["snapshot_hits"] += 1

    def _replay(self, req: Request) -> torch.Tensor | None:
        """The bounded replay of a block hit without a snapshot: one forward of the last
        cached block's tokens and the rest of the prompt; logits of its last row. Under
        `--replay-blocks share`, a prompt with a snapshot boundary past the hit replays up to
        it only, so its snapshot is taken there as a cold prefill's would be (else every later
        request of the prefix replays again), and returns None: the rest of the prompt is
        prefilled in the usual chunks."""
        hit = req.replay.tokens
        req.replay = None
        share = self.ecfg.replay_blocks == "share"
        end = req.snapshot_at if share and req.snapshot_at is not None else len(req.tokens)
        out = self.path.replay(req.seq, req.tokens[:end], hit, req.cut)
        req.replayed_tokens = BLOCK
        self.counters["computed_tokens"] += end - hit + BLOCK
        if share:
            self._after(req)
        else:                 # isolate: blocks completed after a replay are never shared
            req.registered = req.seq.length // BLOCK
        return out[-1] if req.pending == 0 else None

    def _after(self, req: Request) -> None:
        """Register the blocks the step completed; snapshot the prompt boundary it reached."""
        for h, block in self.prefix.register(req.seq, req.chain, req.tokens, req.registered,
                                             req.salt):
            if self.hooks.wants_blocks:
                self.hooks.block_done(h, self.ledgers.blocks.serialize(block), req.traffic_class)
        req.registered = max(req.registered, req.seq.length // BLOCK)
        if req.snapshot_at is not None and req.seq.length == req.snapshot_at:
            self.prefix.take(req.seq, req.chain[req.snapshot_at // BLOCK - 1])
            req.snapshot_at = None

    def _emit(self, req: Request, tokens: list[int]) -> Event:
        """Append the tokens up to the first that finishes the request."""
        out = self.outputs[req.request_id]
        emitted, text, finish = [], "", None
        for token in tokens:
            req.output.append(token)
            emitted.append(token)
            piece, finish = out.push(token, len(req.output))
            text += piece
            if finish is not None:
                break
        self.counters["generated_tokens"] += len(emitted)
        handoff = None
        if finish is None and req.handoff:
            finish, handoff = Finish.HANDOFF, self._hand_off(req)
        drafted = accepted = 0
        if finish is not None:
            drafted, accepted = self.spec.usage.get(req.request_id, (0, 0))
            self._release(req, finish)
            self.counters["finished"] += 1
        return Event(req.request_id, emitted, text, finish, req, handoff, drafted, accepted)

    # --- prefill/decode handoff (core/ledger_handoff.py) ---------------------------------
    def _hand_off(self, req: Request) -> Handoff:
        """Prefill done and the first token sampled: keep the request for a decode engine
        (FetchHandoff reads self.handoffs)."""
        h = ledger_handoff.export(self.ledgers, req, self.prefix.layout_fp, self.cfg.fingerprint())
        self.handoffs.put(h)
        self.counters["handoffs_out"] += 1
        self.counters["handoff_out_bytes"] += h.nbytes
        return h

    @property
    def handoff_state_bytes(self) -> int:
        """Size of the slot state a handoff to this (134-row) engine carries."""
        return self.ledgers.slot_layout.slot_bytes

    @property
    def handoff_max_bytes(self) -> int:
        return self.handoff_state_bytes + self.ecfg.num_blocks * self.ledgers.blocks.bytes_per_block()

    @property
    def block_bytes(self) -> int:
        """Bytes of one serialized block (the handoff stream's unit)."""
        return self.ledgers.blocks.bytes_per_block()

    def held_blocks(self, hashes: list[bytes]) -> list[bytes]:
        """Which of these block hashes this engine's pool holds (a handoff skips them)."""
        return [h for h in hashes if self.ledgers.pool.lookup(h) is not None]

    def adopt(self, h: Handoff) -> Request:
        """Continue a request a prefill engine prefilled: decoding starts at the next step.
        InvalidArgument for a malformed handoff, Unavailable when there is no room here."""
        h.params.validate(self.cfg.vocab_size)
        problem = handoff_problem(h, self.prefix.layout_fp, self.cfg.fingerprint(),
                                  self.cfg.vocab_size) or ledger_handoff.problem(self.ledgers, h.slot)
        if problem is not None:
            raise InvalidArgument(f"handoff refused: {problem}")
        if h.request_id in self.requests:
            raise InvalidArgument(f"request_id {h.request_id!r} is already running")
        req = Request(h.request_id, list(h.prompt), h.params, h.seed, h.salt, h.traffic_class,
                      output=list(h.output), chain=list(h.slot.hashes))
        owed = sum(r.max_blocks() - len(r.seq.blocks) for r in self.running)
        if len(self.running) >= self.ecfg.max_running or \
                not ledger_handoff.room(self.ledgers, h.slot, owed, req.max_blocks()):
            raise Unavailable("handoff refused: no free slot, blocks or running place here")
        self.spec.add(h.request_id, h.params)
        out = OutputState(h.params, self.tokenizer.eos_id, self.tokenizer.stream())
        out.resume(req.output)                # the PE sent the first token's text already
        req.seq, local = ledger_handoff.adopt(self.ledgers, h.slot)
        req.registered = len(h.slot.hashes)
        self.requests[req.request_id] = req
        self.outputs[req.request_id] = out
        req.scheduled_s = time.monotonic()
        self.running.append(req)
        c = self.counters
        c["requests"] += 1
        c["handoffs_in"] += 1
        c["handoff_in_bytes"] += h.nbytes
        c["handoff_blocks_local"] += local
        return req

    def _release(self, req: Request, finish: Finish) -> None:
        req.finish = finish
        self.spec.forget(req.request_id)
        if req.seq is not None:
            self.ledgers.close(req.seq)
            req.seq = None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
        self.outputs.pop(req.request_id, None)

    def check_integrity(self) -> None:
        """The block pool's own invariants, and every held slot and block belonging to a
        running request (AssertionError otherwise)."""
        led = self.ledgers
        led.pool.check_integrity()
        assert led.free_slots + len(self.running) == self.ecfg.num_slots, "a slot leaked"
        held = Counter(b for r in self.running for b in r.seq.blocks)
        for b, refs in enumerate(led.pool.ref_cnt):
            assert refs == held[b], f"block {b}: {refs} references, {held[b]} holders"

    def stats(self) -> dict[str, float]:
        pool = self.ledgers.pool.stats()
        out = {k: float(v) for k, v in self.counters.items()}
        out.update(self.spec.stats())
        out.update(blocks_total=pool.total, blocks_in_use=pool.in_use, blocks_cached=pool.cached,
                   slots_total=self.ecfg.num_slots,
                   slots_in_use=self.ecfg.num_slots - self.ledgers.free_slots,
                   running=len(self.running), waiting=len(self.waiting),
                   snapshot_bytes=self.prefix.store.bytes, snapshots=len(self.prefix.store))
        return out

