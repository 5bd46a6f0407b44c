"""What the MTP tests of both model families check alike: record every proposal an engine's
MTP drafter makes in a run (each depth's logits as computed), and compare them with the
module run over the whole final sequence at once from the trunk's whole-sequence streams."""

from __future__ import annotations

import torch

from kvmesh.services.engine.core.mtp_draft import MtpDrafter
from kvmesh.services.engine.model.deepseek_v4.attention import AttentionParts


def without_tensor(directory, into, name: str):
    """A copy of the one-file checkpoint `directory` in `into`, lacking tensor `name`."""
    from safetensors.torch import load_file, save_file
    state = load_file(str(directory / "model.safetensors"))
    del state[name]
    for f in directory.iterdir():
        if f.name != "model.safetensors":
            (into / f.name).write_bytes(f.read_bytes())
    save_file(state, str(into / "model.safetensors"))
    return into


def recorded(monkeypatch, module_cls, go):
    """go() under a recording drafter -> (go's result, proposals): per proposal the length it
    drafted at, the drafts, and each draft depth's logits."""
    seen, rows = [], []
    real, real_logits = MtpDrafter.propose, module_cls.logits

    def logits(self, y):
        out = real_logits(self, y)
        rows.append(out[0].clone())
        return out

    def recording(self, wanted):
        rows.clear()
        out = real(self, wanted)
        for req, _ in wanted:
            if req.request_id in out:
                seen.append((req.seq.length, list(out[req.request_id]), torch.stack(rows)))
        return out
    monkeypatch.setattr(MtpDrafter, "propose", recording)
    monkeypatch.setattr(module_cls, "logits", logits)
    result = go()
    monkeypatch.undo()
    return result, seen


def worst_difference(module, trunk: torch.Tensor, tokens: torch.Tensor, seen) -> tuple[float, int]:
    """Largest |logit difference| between the recorded proposals and the module over the whole
    sequence (trunk: its last-layer streams of `tokens`), first drafts and the chained row
    after each; and how many chained rows were checked."""
    n = len(tokens)
    y, parts = module.rows(torch.arange(n - 1), tokens[1:], trunk[:-1])
    reference = module.logits(y)                   # row p predicts token p + 2
    worst, chained = 0.0, 0
    for end, drafts, q in seen:
        worst = max(worst, (q[0] - reference[end - 1]).abs().max().item())
        if len(drafts) > 1:                        # the chained row after it
            prior = AttentionParts(None, parts.window_kv[:end], None, None, None)
            y2, _ = module.rows(torch.tensor([end]), torch.tensor(drafts[:1]), y[end - 1:end],
                                prior)
            worst = max(worst, (q[1] - module.logits(y2)[0]).abs().max().item())
            chained += 1
    return worst, chained
