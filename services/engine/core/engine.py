"""EngineCore: the synchronous heart of an engine. No threads, no gRPC.

    add_request()  validate, queue a Sequence
    step()         schedule -> forward (one batched decode + prefill chunks) -> sample
                   -> return one Event per sequence that produced something
    abort()        drop a request and free its slot and blocks

Only the thread that calls step() may call the others (AsyncEngine serializes
them). Owners: EngineCore owns `requests`, `outputs`, `counters` and
`prefill_token_s`; the Scheduler owns the queues, the CacheManager the pools,
the snapshot store (through its PrefixReuse) and every sequence's cache fields
(sequence.py lists each field's writer). The engine only reads the StepPlan the
scheduler returns and counts what it says.
"""

from __future__ import annotations

import random
import time
import uuid
import weakref
from collections import Counter
from dataclasses import replace

import torch

from kvmesh.errors import InvalidArgument, Unavailable
from kvmesh.generation import check_traffic_class
from kvmesh.tokenizer import ByteTokenizer
from services.engine import device as device_mod
from services.engine.cache.handoff import handoff_block
from services.engine.cache.layout import RuntimeLayout
from services.engine.cache.manager import CacheManager, MatchResult
from services.engine.cache.prefetch import Prefetched
from services.engine.cache.prefix import PrefixReuse
from services.engine.config import EngineConfig, ModelConfig
from services.engine.core.events import COUNTERS, Event, Hooks  # noqa: F401  (importers)
from services.engine.core.handoff import (
    Exports,
    Handoff,
    HandoffStore,
    export_handoff,
    handoff_problem,
)
from services.engine.core.mtp_draft import MtpDrafter
from services.engine.core.output import OutputState
from services.engine.core.request_checks import check_prompt
from services.engine.core.sampling import (
    SamplingParams,
    attach_logprobs,
    draw_batch,
    penalize,
    read_ids,
    sample,
)
from services.engine.core.scheduler import Scheduler
from services.engine.core.sequence import Finish, Sequence
from services.engine.core.speculative import Speculator, engine_setting
from services.engine.model import mtp
from services.engine.model.mtp_runner import MtpRunner
from services.engine.model.runner import ForwardResult, ModelRunner, Work
from services.engine.model.weights import Weights, init_weights


class EngineCore:
    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, weights: Weights | None = None,
                 tokenizer=None, layout: RuntimeLayout | None = None):
        """`layout`, when given, must have been built from these two configs (the CLI builds
        it once and hands the same object here); otherwise it is built now."""
        self.layout = layout if layout is not None else RuntimeLayout.build(cfg, ecfg)
        if (self.layout.model, self.layout.engine) != (cfg, ecfg):
            raise ValueError("layout was built from other configs than this engine's")
        self.cfg, self.ecfg = cfg, ecfg
        dtype = getattr(torch, ecfg.dtype)
        self.device = device_mod.resolve(ecfg.device)     # ValueError naming --device
        weights = weights if weights is not None else init_weights(cfg, ecfg.seed, dtype)
        self.weights = {k: v.to(self.device) for k, v in weights.items()}
        self.tokenizer = tokenizer or ByteTokenizer()
        if self.tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer has {self.tokenizer.vocab_size} ids, model only {cfg.vocab_size}")
        self.cache = CacheManager(self.layout, self.device)
        dec_mode = "mask" if ecfg.truncation == "mask" else "compact"
        self.runner = ModelRunner(cfg, self.weights, self.cache.states, self.cache.store, dec_mode)
        self.scheduler = Scheduler(ecfg, self.cache)
        self.requests: dict[str, Sequence] = {}
        self.outputs: dict[str, OutputState] = {}
        self.counters: Counter = Counter(dict.fromkeys(COUNTERS, 0))
        self.prefix: PrefixReuse = self.cache.snapshots     # capture/store around forwards
        self.hooks = Hooks()
        # through a weak proxy: the store is ours, and callbacks holding the engine itself
        # made a cycle that kept every engine (its weights, pools and packed panels: ~50 MB
        # for tiny) alive until a full garbage collection, in processes that build many
        me = weakref.proxy(self)
        self.prefix.store.on_put = lambda snap: me._snapshot_stored(snap)
        self.prefix.store.on_evict = lambda key: me.hooks.snapshot_evicted(key)
        self.prefill_token_s = 0.0       # EMA of prefill seconds per token (replay cost model)
        self.last_rows: dict[str, int] = {}     # query rows the last step's forward computed
        # handoffs waiting for a decode engine to fetch them (prefill engines): as many bytes
        # as the snapshot store may hold, for as long as a fetch may reasonably take
        self.handoffs = HandoffStore(ecfg.snapshot_bytes, ttl_s=60.0)
        # speculative decoding: K <= B, mtp only with MTP weights (InvalidArgument at start-up)
        setting = engine_setting(ecfg.speculative, self.layout.backtrack, mtp.has_mtp(self.weights))
        drafter = MtpDrafter(MtpRunner(cfg, self.weights, self.cache.states), cfg.window) \
            if setting.method == "mtp" else None
        self.spec = Speculator(setting, ecfg.ngram_min, ecfg.ngram_max, drafter,
                               adaptive=ecfg.spec_policy == "adaptive" and not ecfg.deterministic)
        # completed blocks on their way to hooks.block_done and handoff exports on their way
        # to self.handoffs (pinned, non-blocking on CUDA)
        self.copies = device_mod.HostCopies(self.device)
        self.exports = Exports()

    # --- requests ----------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "",
                    salt: str = "", traffic_class: str = "",
                    prefetched: Prefetched | None = None, resume: int = 0,
                    handoff: bool = False) -> Sequence:
        """`resume` > 0 continues a generation that another engine started (the gateway's
        mid-stream migration): the last `resume` ids are that generation's output. They
        count toward max_tokens and usage, sampling continues at their position (same
        seed, same tokens as an uninterrupted run), and their text, already delivered,
        only sets the stop-string state. `handoff`: stop after the first token and keep
        the request for a decode engine (core/handoff.py)."""
        n_prompt = check_prompt(prompt_ids, params, resume, self.cfg.vocab_size,
                                self.cfg.max_seq_len)
        if self.cache.blocks_for(len(prompt_ids) + 1) > self.ecfg.num_blocks:
            raise InvalidArgument(f"prompt needs more cache blocks than this engine has "
                                  f"({self.ecfg.num_blocks} x {self.cfg.block_size} tokens)")
        check_traffic_class(traffic_class)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidArgument(f"request_id {request_id!r} is already running")
        self.spec.add(request_id, params)
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        seq = Sequence(request_id, list(prompt_ids[:n_prompt]), params, seed, salt, traffic_class,
                       handoff=handoff, output=list(prompt_ids[n_prompt:]), prefetched=prefetched,
                       # hashed for the prefetch from these very ids and salt: the chain's start
                       block_hashes=list(prefetched.hashes) if prefetched else [])
        out = OutputState(params, self.tokenizer.eos_id, self.tokenizer.stream())
        out.resume(seq.output)            # raises InvalidArgument if they already finished
        self.requests[request_id] = seq
        self.outputs[request_id] = out
        self.scheduler.add(seq)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(prompt_ids)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        self.outputs.pop(request_id, None)
        self.spec.forget(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, Finish.ABORTED)
            self.counters["aborted"] += 1

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # --- what the remote tiers ask (rpc/remote.py), on the engine thread -------------
    @property
    def snapshot_size(self) -> int:
        """Bytes of one stored snapshot (a peer's is refused unless it has this size)."""
        return self.cache.states.block.state_size_to_disk

    def local_view(self, prompt_ids: list[int], salt: str):
        """The prompt's block hashes and what of them this engine holds (cache.LocalView)."""
        return self.cache.local_view(prompt_ids, salt)

    # --- one step ------------------------------------------------------------------
    def step(self) -> list[Event]:
        t_step = time.perf_counter()
        self._deliver_copies(wait=False)       # earlier steps' block and snapshot bytes
        proposed = self.spec.propose(self.scheduler.running)
        plan = self.scheduler.schedule({r: len(d) for r, d in proposed.items()})
        for _, match in plan.admitted:
            self._count_hit(match)
        events = [self._finish(seq, [], "") for seq in plan.out_of_memory]
        sampled: list[tuple[Sequence, torch.Tensor]] = []
        verifying: list[tuple[Sequence, Work, int, list[int]]] = []
        # one ragged forward for the whole step: decode rows (with their drafts) and prefill
        # chunks side by side
        drafts = {s.request_id: proposed[s.request_id][: plan.drafts[s.request_id]]
                  for s in plan.decode if s.request_id in plan.drafts}
        jobs = [(s, s.num_computed, s.num_tokens) for s in plan.decode] + plan.prefill
        if jobs:
            works = [self._work(seq, start, end, drafts.get(seq.request_id, []))
                     for seq, start, end in jobs]
            t0 = time.perf_counter()
            res = self.runner.forward(works)
            self.last_rows = res.rows
            prefill_tokens = sum(end - start for _, start, end in plan.prefill)
            if prefill_tokens:
                # the step's time charged to its tokens (decode rows included): the replay
                # cost model wants seconds per computed token at the current batch mix
                per_token = (time.perf_counter() - t0) / sum(w.end - w.start for w in works)
                self.prefill_token_s = per_token if not self.prefill_token_s else \
                    0.8 * self.prefill_token_s + 0.2 * per_token
            for i, ((seq, _, _), work) in enumerate(zip(jobs, works, strict=True)):
                if seq.request_id in drafts:          # committed once its drafts are judged
                    verifying.append((seq, work, i, drafts[seq.request_id]))
                    continue
                self._after_forward(seq, work, res, i)
                self.spec.observe(seq, work.owner, res.hidden.get(i), work.end)
                logits = res.logits.get(i)
                if logits is not None and not seq.prefilling:
                    sampled.append((seq, logits))
        self.counters["steps"] += 1
        if self.counters["steps"] % 256 == 0:      # reclaim expired snapshots even if unread
            self.prefix.expire()
        # the step's one device sync: every sampled id and every verification verdict
        # (speculative.judge, drawn on the device) in one host read (sampling.read_ids)
        parts, where = draw_batch([(penalize(logits, seq.params, seq.prompt, seq.output),
                                    seq.params, len(seq.output), seq.seed)
                                   for seq, logits in sampled])
        read = read_ids(parts + [self.spec.judge(seq, res.logits[i], d)
                                 for seq, _, i, d in verifying])
        emitted = [self._emit(seq, logits, token=read[part][at])
                   for (seq, logits), (part, at) in zip(sampled, where, strict=True)]
        attach_logprobs(emitted, [logits for _, logits in sampled],
                        [seq.params.logprobs for seq, _ in sampled])
        events.extend(emitted)
        for (seq, work, i, d), verdict in zip(verifying, read[len(parts):], strict=True):
            events.append(self._verify(seq, work, res, i, d, verdict))
        # the step's time, its one device sync included, sizes the prefill work of later
        # steps beside decodes (scheduler.costs: StepCosts, --itl-ratio)
        step_s = time.perf_counter() - t_step
        draft_rows = sum(len(d) for d in drafts.values())
        prefill_tokens = sum(end - start for _, start, end in plan.prefill)
        self.scheduler.costs.observe(len(plan.decode) + draft_rows, prefill_tokens, step_s)
        self.spec.step_done(len(plan.decode), draft_rows, prefill_tokens, step_s)
        if not self.has_work:
            self._deliver_copies(wait=True)    # idle: nothing left to overlap them with
        return self.exports.ready(events)      # handoff events once their bytes landed

    def _deliver_copies(self, wait: bool) -> None:
        """Device-to-host copies (blocks for upload, snapshots for the store) that have
        landed, or all of them with `wait`; on the CPU there are never any pending."""
        self.copies.poll(wait)
        self.prefix.copies.poll(wait)

    def _work(self, seq: Sequence, start: int, end: int, drafts: list[int] = ()) -> Work:
        # a view, not prompt + output: the step reads only tokens[start:end]
        work = Work(seq.slot, seq.table, seq.token_view(drafts), start,
                    end + len(drafts), enc_lo=seq.enc_lo, dec_lo=seq.dec_lo, cmp_from=seq.cmp_from,
                    want_logits=end == seq.num_tokens, n_logits=1 + len(drafts),
                    owner=(seq.request_id, seq.admitted_at),
                    want_hidden=self.cfg.window if self.spec.wants_hidden(seq.request_id) else 0)
        if seq.prefilling:
            self.prefix.capture_for(seq, work)
        return work

    def _after_forward(self, seq: Sequence, work: Work, res, index: int) -> None:
        for h, block in self.cache.commit(seq, work.end):
            if self.hooks.wants_blocks:
                cls = seq.traffic_class
                self.copies.submit(self.cache.store.raw(block), lambda raw, h=h, cls=cls:
                                   self.hooks.block_done(h, self.cache.store.frame(raw), cls))
        self.prefix.after_forward(seq, work, res, index)
        self.counters["computed_tokens"] += work.end - work.start

    def _count_hit(self, match: MatchResult) -> None:
        c = self.counters
        c["remote_blocks_refused"] += match.refused_blocks
        c["snapshot_refused"] += match.refused_snapshots
        if not match.l1:
            return
        if match.snapshot is not None:
            c["snapshot_hits"] += 1
            c["recomputed_tokens"] += match.recomputed
        else:
            c["snapshot_misses"] += 1
            c["replayed_tokens"] += match.replayed
        c["cache_hit_tokens"] += match.l1
        c["block_hits_" + match.source] += len(match.blocks)

    def _snapshot_stored(self, snap) -> None:
        self.counters["snapshot_stores"] += 1
        self.hooks.snapshot_stored(snap.key, snap)

    def _emit(self, seq: Sequence, logits: torch.Tensor, drafts: list[int] | None = None,
              work: Work | None = None, token: int | None = None,
              verdict: list[int] | None = None) -> Event:
        """Emit `token` (sampled from logits [V] by step, with the others of the step), or
        sample it here; or, with drafts, emit what verification gives (their `verdict`,
        judged by step with the others, or judged here against logits [1 + k, V]),
        committing the accepted ones."""
        if drafts is None:
            tokens = [token if token is not None else
                      sample(penalize(logits, seq.params, seq.prompt, seq.output), seq.params,
                             len(seq.output), seq.seed)]
        elif verdict is not None:
            tokens = self.spec.settle(seq, drafts, verdict)
        else:
            tokens = self.spec.verify(seq, logits, drafts)
        out = self.outputs[seq.request_id]
        emitted, text, finish = [], "", None
        for token in tokens:
            self.cache.append_token(seq, token)
            emitted.append(token)
            piece, finish = out.push(token, len(seq.output))
            text += piece
            if finish:
                break
        self.counters["generated_tokens"] += len(emitted)
        if work is not None:
            self._commit_verified(seq, work)
        if finish:
            return self._finish(seq, emitted, text, finish)
        if seq.handoff:
            return self._hand_off(seq, emitted, text)
        return Event(seq.request_id, emitted, text, None, seq)

    def _verify(self, seq: Sequence, work: Work, res, index: int, drafts: list[int],
                verdict: list[int]) -> Event:
        event = self._emit(seq, res.logits[index], drafts, work, verdict=verdict)
        if event.finish is None:      # the MTP drafter continues from the kept positions
            self.spec.observe(seq, work.owner, res.hidden.get(index), seq.num_computed)
        return event

    def _commit_verified(self, seq: Sequence, work: Work) -> None:
        """After a verify step: commit the pending token and the accepted drafts only. The
        rows of rejected drafts stay uncommitted: their blocks are trimmed, their ring and
        tail rows are rewritten before they are read (cache/manager.py reopen/rollback),
        and the replica rule sees only the committed end."""
        end = seq.num_tokens - 1             # the last emitted token is pending
        kept = replace(work, end=end)
        self._after_forward(seq, kept, ForwardResult(), -1)
        self.counters["computed_tokens"] += work.end - end       # rejected rows were computed too
        self.cache.trim(seq)
        if work.end > end:
            self.runner.rewind(seq.slot, work.owner, end)

    # --- prefill/decode handoff (core/handoff.py) ------------------------------------
    def _hand_off(self, seq: Sequence, tokens: list[int], text: str) -> Event:
        """Prefill done and the first token sampled: keep the request for a decode engine.
        Its slot and blocks are copied off the step (stream order keeps the copy ahead of
        any reuse of the slot and blocks freed now); the event leaves once they landed."""
        data, build = self.cache.export_parts(seq)
        fps = (self.prefix.layout_fp, self.cfg.fingerprint())
        event = self._finish(seq, tokens, text, Finish.HANDOFF)

        def landed(raw: bytes) -> None:
            h = export_handoff(seq, build(raw), *fps)
            self.handoffs.put(h)
            self.counters["handoffs_out"] += 1
            self.counters["handoff_out_bytes"] += h.nbytes
            self.exports.land(event, h)
        self.exports.hold(event)
        self.copies.submit(data, landed)
        return event

    @property
    def handoff_state_bytes(self) -> int:
        """Size of the slot state a handoff to this (134-row) engine carries."""
        return handoff_block(self.cache.states.block).slot_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one serialized block (the handoff stream's unit)."""
        return self.cache.store.bytes_per_block()

    def held_blocks(self, hashes: list[bytes]) -> list[bytes]:
        """Which of these block hashes this engine's pool holds (a handoff skips them)."""
        return [h for h in hashes if self.cache.pool.lookup(h) is not None]

    @property
    def handoff_max_bytes(self) -> int:
        """The most a handoff adopted here can weigh: the state and every block of the pool."""
        return self.handoff_state_bytes + self.ecfg.num_blocks * self.cache.store.bytes_per_block()

    def adopt(self, h: Handoff) -> Sequence:
        """Continue a request another engine prefilled: decoding starts at the next step.
        InvalidArgument for a malformed handoff, Unavailable when there is no room here."""
        h.params.validate(self.cfg.vocab_size)
        problem = handoff_problem(h, self.prefix.layout_fp, self.cfg.fingerprint(), self.cfg.vocab_size)
        if problem is None:
            problem = self.cache.handoff_problem(h.slot)
        if problem is not None:
            raise InvalidArgument(f"handoff refused: {problem}")
        if not (self.scheduler.can_adopt and self.cache.has_room(h.slot)):
            raise Unavailable("handoff refused: no free slot, blocks or running place here")
        if h.request_id in self.requests:
            raise InvalidArgument(f"request_id {h.request_id!r} is already running")
        self.spec.add(h.request_id, h.params)     # a decode engine speculates on what it adopts
        seq = Sequence(h.request_id, list(h.prompt), h.params, h.seed, h.salt, h.traffic_class,
                       output=list(h.output))
        out = OutputState(h.params, self.tokenizer.eos_id, self.tokenizer.stream())
        out.resume(seq.output)                # the PE sent the first token's text already
        local = self.cache.adopt(seq, h.slot)
        self.scheduler.adopt(seq)
        self.requests[seq.request_id] = seq
        self.outputs[seq.request_id] = out
        c = self.counters
        c["requests"] += 1
        c["handoffs_in"] += 1
        c["handoff_in_bytes"] += h.nbytes
        c["handoff_blocks_local"] += local
        return seq

    def _finish(self, seq: Sequence, tokens, text, finish: Finish | None = None,
                handoff: Handoff | None = None) -> Event:
        finish = finish or seq.finish            # out of memory: the scheduler chose LENGTH
        self.scheduler.finish(seq, finish)
        self.requests.pop(seq.request_id, None)
        self.outputs.pop(seq.request_id, None)
        drafted, accepted = self.spec.usage.get(seq.request_id, (0, 0))
        self.spec.forget(seq.request_id)
        self.counters["finished"] += 1
        return Event(seq.request_id, tokens, text, finish, seq, handoff, drafted, accepted)

    def rollback(self, request_id: str, r: int) -> None:
        """Take back the last r computed tokens of a running request (speculative decoding)."""
        seq = self.requests[request_id]
        self.cache.rollback(seq, r, self.layout.backtrack)

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.scheduler.running)

    def stats(self) -> dict[str, float]:
        pool = self.cache.pool.stats()
        out = {k: float(v) for k, v in self.counters.items()}
        out.update(blocks_total=pool.total, blocks_in_use=pool.in_use, blocks_cached=pool.cached,
                   slots_total=self.cache.states.num_slots,
                   slots_in_use=self.cache.states.num_slots - self.cache.states.num_free,
                   running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                   snapshot_bytes=self.prefix.store.bytes, snapshots=len(self.prefix.store))
        out.update(self.spec.stats())
        return out
