"""`kvmesh up`'s engine flags reach every engine it starts (and the gateway, for the
tokenizer): the mesh's launch lines are parsed back by the same `kvmesh` parser."""

from __future__ import annotations

from kvmesh.launch.cli import build_parser
from kvmesh.launch.mesh import Mesh, engine_argv
from kvmesh.launch.up import mesh_config


def _engine_args(argv: list[str]):
    return build_parser().parse_args(argv[3:])       # past `python -m kvmesh.launch.cli`


def test_up_flags_pass_through_to_every_engine(tmp_path):
    args = build_parser().parse_args(
        ["up", "--model", str(tmp_path), "--tokenizer", "tok.json", "--dtype", "float64",
         "--device", "cpu", "--speculative", "ngram:3", "--num-engines", "3", "--pd"])
    cfg = mesh_config(args)
    for i, role in enumerate(("prefill", "decode", "decode")):
        e = _engine_args(engine_argv(cfg, f"engine-{i}", 7200 + i, "d:1", "k:2", role))
        assert (e.model, e.tokenizer, e.dtype, e.device, e.speculative, e.role) == \
            (str(tmp_path), "tok.json", "float64", "cpu", "ngram:3", role)
    assert Mesh(cfg)._tokenizer_args() == ["--tokenizer", "tok.json"]


def test_without_them_engines_keep_their_defaults(tmp_path):
    from kvmesh.services.engine.build import DEFAULT_MODEL, choose_model

    cfg = mesh_config(build_parser().parse_args(["up"]))
    e = _engine_args(engine_argv(cfg, "engine-a", 7201, "d:1", "k:2"))
    defaults = build_parser().parse_args(["engine", "serve"])
    choose_model(defaults)                   # an engine given no model serves the shipped one
    assert (e.model, e.tokenizer, e.dtype, e.device, e.speculative) == \
        (defaults.model, defaults.tokenizer, defaults.dtype, defaults.device, defaults.speculative)
    assert e.model == str(DEFAULT_MODEL)
    assert Mesh(cfg)._tokenizer_args() == ["--tokenizer", str(DEFAULT_MODEL / "tokenizer.json")]
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = mesh_config(build_parser().parse_args(["up", "--model", str(tmp_path)]))
    assert Mesh(cfg)._tokenizer_args() == ["--tokenizer", str(tmp_path / "tokenizer.json")]


def test_truncation_is_explicit_on_every_engine_and_follows_the_model(tmp_path):
    """`kvmesh up` gives engines --truncation and --keep-tokens explicitly (KEEP must be
    explicit): compact / 134 on V4.1 (the shipped model), off on DeepSeek V4, as asked."""
    import json

    def engine(*flags):
        cfg = mesh_config(build_parser().parse_args(["up", *flags]))
        return _engine_args(engine_argv(cfg, "engine-a", 7201, "d:1", "k:2"))

    e = engine()
    assert (e.truncation, e.keep_tokens) == ("compact", 134)
    v4 = tmp_path / "v4"
    v4.mkdir()
    (v4 / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    assert engine("--model", str(v4)).truncation == "off"
    assert (engine("--truncation", "mask", "--keep-tokens", "200").truncation,
            engine("--truncation", "mask", "--keep-tokens", "200").keep_tokens) == ("mask", 200)
    assert engine("--truncation", "off").truncation == "off"


def test_a_second_up_on_the_same_log_dir_is_refused_by_pid(tmp_path):
    import os
    import subprocess
    import sys

    from kvmesh.running import AlreadyRunning, claim, release

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "kvmesh-up.pid").write_text(str(holder.pid))
        out = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "up", "--log-dir",
                              str(tmp_path)], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": "200"})
        assert out.returncode == 1
        assert f"already running on {tmp_path} (pid {holder.pid})" in out.stderr
    finally:
        holder.kill()
        holder.wait()
    mark = claim(tmp_path)                   # its process is gone: taken over
    assert mark.read_text() == str(os.getpid())
    try:
        claim(tmp_path)
        raise AssertionError("a live mark was claimed twice")
    except AlreadyRunning:
        pass
    release(mark)
    assert not mark.exists()


def test_metrics_ports_are_fixed_by_default_and_free_on_0():
    """Every service's /metrics port under `kvmesh up` is known before it starts: the
    gateway's --metrics-port (9100), then the directory, the kvstores and the engines."""
    m = Mesh(mesh_config(build_parser().parse_args(["up", "--num-kvstores", "2", "--num-engines", "3"])))
    ports = {n: m._metrics_port(n) for n in ("gateway", "directory", *m.kvstore_names,
                                              *m.engine_names)}
    assert list(ports.values()) == list(range(9100, 9107))
    assert ports["gateway"] == 9100 and ports["directory"] == 9101
    free = Mesh(mesh_config(build_parser().parse_args(["up", "--metrics-port", "0"])))
    assert free._metrics_port("gateway") != 9100 and free._metrics_port("engine-a") != 9104


def test_split_engines_get_the_split_flags():
    """`kvmesh up --tensor-parallel 2 --expert-parallel 2`: every engine serve gets both (and a
    plain `kvmesh up` neither, so engines run as one process)."""
    cfg = mesh_config(build_parser().parse_args(["up", "--tensor-parallel", "2",
                                                 "--expert-parallel", "2"]))
    e = _engine_args(engine_argv(cfg, "engine-a", 7201, "d:1", "k:2"))
    assert (e.tensor_parallel, e.expert_parallel) == (2, 2)
    plain = engine_argv(mesh_config(build_parser().parse_args(["up"])), "engine-a", 7201, "d:1",
                        "k:2")
    assert "--tensor-parallel" not in plain and "--expert-parallel" not in plain

