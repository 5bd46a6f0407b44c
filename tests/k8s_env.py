"""Helpers for tests/test_k8s.py: rendered overlays, a container's environment, quantities.

A container's environment is resolved as the kubelet would: ConfigMaps named by
`envFrom`, then `env` entries, with Secret keys taken from the external overlay's
backing.env.example and downward-API fields from FIELD_VALUES.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from pathlib import Path

from kvmesh.launch.cli import build_parser
from tests.kustomize import render

ROOT = Path(__file__).resolve().parents[1]
ENV_EXAMPLE = ROOT / "deploy/k8s/overlays/external/backing.env.example"
FIELD_VALUES = {"metadata.name": "engine-5d8f7c-x2x9q", "status.podIP": "10.1.2.3"}
_UNITS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


@functools.cache
def _rendered(overlay: str) -> tuple[dict, ...]:
    return tuple(render(ROOT / "deploy/k8s/overlays" / overlay))


def rendered(overlay: str) -> list[dict]:
    """The overlay's resources (a fresh copy: tests may not change each other's)."""
    return copy.deepcopy(list(_rendered(overlay)))


def image_path(path: str) -> Path:
    """Where a path inside the kvmesh image (the Dockerfile's WORKDIR /app, into which it
    copies models/) lies in this checkout."""
    assert path.startswith("/app/"), path
    return ROOT / path.removeprefix("/app/")


def check_serves_the_shipped_model(args) -> None:
    """An engine's parsed flags name the image's shipped default model, whose config passes
    the engine's start-up checks under these flags' settings (truncation: KEEP >= W + B)."""
    from kvmesh.services.engine.build import engine_config
    from kvmesh.services.engine.model.deepseek_v4.v41_config import read_v41_config
    from kvmesh.shipped import DEFAULT_MODEL

    assert image_path(args.model) == DEFAULT_MODEL, args.model
    engine_config(args).check_model(read_v41_config(DEFAULT_MODEL))


BUNDLED_ENV_EXAMPLE = ROOT / "deploy/k8s/overlays/bundled/backing.env.example"


def secret_values() -> dict[str, str]:
    """The `kvmesh-backing` Secret's keys, as each overlay's backing.env.example lists them."""
    out: dict[str, str] = {}
    for path in (ENV_EXAMPLE, BUNDLED_ENV_EXAMPLE):
        lines = path.read_text().splitlines()
        out.update(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    return out


def container_env(resources: list[dict], container: dict) -> dict[str, str]:
    maps = {r["metadata"]["name"]: r.get("data", {}) for r in resources if r["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]])
        else:       # the token Secrets (scripts/backing_secrets.py --k8s-token): one key each
            name = source["secretRef"]["name"]
            key = {"kvmesh-service-token": "KVMESH_SERVICE_TOKEN",
                   "kvmesh-admin-token": "KVMESH_ADMIN_TOKEN"}[name]
            env[key] = "token-of-" + name
    for e in container.get("env", []):
        ref = e.get("valueFrom", {})
        if "secretKeyRef" in ref:
            env[e["name"]] = secret_values()[ref["secretKeyRef"]["key"]]
        elif "fieldRef" in ref:
            env[e["name"]] = FIELD_VALUES[ref["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = expand([e["value"]], env)[0]
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion (an undefined reference stays as written)."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), a) for a in args]


def workload(res: list[dict], name: str) -> dict:
    [w] = [r for r in res if r["kind"] in ("Deployment", "StatefulSet")
           and r["metadata"]["name"] == name]
    return w


def main_container(w: dict) -> dict:
    return w["spec"]["template"]["spec"]["containers"][0]


def argv(res: list[dict], name: str) -> list[str]:
    c = main_container(workload(res, name))
    return expand(c["command"] + c.get("args", []), container_env(res, c))


def parse(res: list[dict], name: str):
    cmd = argv(res, name)
    assert cmd[:3] == ["kvmesh", name, "serve"], cmd
    return build_parser().parse_args(cmd[1:])


def services(res: list[dict]) -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in res if r["kind"] == "Service"}


def selected(res: list[dict], selector: dict) -> list[dict]:
    return [r for r in res if r["kind"] in ("Deployment", "StatefulSet")
            and selector.items() <= r["spec"]["template"]["metadata"]["labels"].items()]


def named_port(container: dict, name: str) -> int:
    [port] = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def grpc_port(probe: dict) -> int | None:
    for kind in ("grpc", "tcpSocket"):
        if kind in probe:
            return probe[kind]["port"]
    return None


def quantity(text: str | int) -> float:
    """A Kubernetes quantity ('500m', '2', '4Gi') as a number."""
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()
    return float(number) * _UNITS[unit]


memory_bytes = quantity


def use_env(monkeypatch, env: dict[str, str]) -> None:
    """Replace every KVMESH_* and AWS_* variable of this process by `env` (for this test)."""
    for name in list(os.environ):
        if name.startswith(("KVMESH_", "AWS_")):
            monkeypatch.delenv(name)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
