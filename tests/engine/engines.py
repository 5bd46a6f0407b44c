"""Engines for the tests of the machinery around the model (the async loop, the gRPC
service, resume, kvstore blocks): the shipped model, built the way `kvmesh engine serve`
builds it, so these tests exercise what a user runs."""

from __future__ import annotations

import argparse

import torch

from kvmesh.services.engine.build import add_engine_args, build_core
from kvmesh.services.engine.core.engine import Engine


def serve_core(*flags: str) -> Engine:
    """The core `kvmesh engine serve` builds from `flags` (float32 and the shipped model
    unless they say otherwise)."""
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return build_core(p.parse_args(["--dtype", "float32", *flags]))


def run_to_completion(core: Engine, max_steps: int = 100_000) -> int:
    """Steps until nothing runs or waits, checking the ledgers after every step."""
    steps = 0
    while core.has_work:
        core.step()
        core.check_integrity()
        steps += 1
        assert steps < max_steps
    return steps


def random_prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()
