"""`kvmesh score --tensor-parallel N --expert-parallel M`: the model split over ranks scores
what one process does (float64: log-probabilities within 1e-9, the same argmax), whether the
command starts the ranks itself or each rank is started by an external launcher (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun sets them); a split the config does not
divide, or a WORLD_SIZE that is not N x M, is refused before any rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.deepseek_v4 import tiny

ROOT = Path(__file__).resolve().parents[3]
IDS = "1,5,9,14,2,77,31,8,8,60,3,42,17,99,0,25,64,11,7,50"


def score(directory: Path, *flags: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvmesh.launch.cli", "score", "--model", str(directory),
                             "--ids", IDS, "--dtype", "float64", *flags], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v4")
    tiny.save("mixed", directory)
    code, out, err = finish(score(directory))
    assert code == 0, err
    return directory, json.loads(out)


def same(got: dict, want: dict) -> None:
    assert got["ids"] == want["ids"] and got["argmax"] == want["argmax"]
    assert got["logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(got["logprobs"][1:], want["logprobs"][1:], strict=True)) <= 1e-9


def test_the_command_starts_tp_x_ep_ranks_and_scores_what_one_process_does(checkpoint):
    directory, want = checkpoint
    code, out, err = finish(score(directory, "--tensor-parallel", "2", "--expert-parallel", "2"))
    assert code == 0, err
    same(json.loads(out), want)
    assert "perplexity" in err


def test_ranks_an_external_launcher_started_join_its_group(checkpoint):
    from kvmesh.launch.backing.proc import free_port

    directory, want = checkpoint
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [score(directory, "--expert-parallel", "2", env={**env, "RANK": str(r),
                                                             "LOCAL_RANK": str(r)})
             for r in range(2)]
    (code0, out0, err0), (code1, out1, err1) = [finish(p) for p in procs]
    assert code0 == 0 and code1 == 0, (err0, err1)
    same(json.loads(out0), want)
    assert out1 == ""                        # rank 1 computed its share and printed nothing


def test_a_split_that_does_not_fit_is_refused_before_any_rank_starts(checkpoint, capsys,
                                                                     monkeypatch):
    from kvmesh.launch.cli import main

    directory, _ = checkpoint
    base = ["score", "--model", str(directory), "--ids", IDS]
    assert main([*base, "--expert-parallel", "3"]) == 2
    assert "n_routed_experts (4) is not divisible by 3" in capsys.readouterr().err
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    assert main([*base, "--tensor-parallel", "2"]) == 2
    assert "WORLD_SIZE is 4, but --tensor-parallel 2 x --expert-parallel 1" in \
        capsys.readouterr().err
