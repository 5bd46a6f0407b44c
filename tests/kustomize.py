"""Render a kustomization in Python: the subset of kustomize that deploy/k8s uses.

No kubectl or kustomize binary on the test machines, so tests/test_k8s.py renders the
overlays with this. It applies, in kustomize's order: `resources` (files, and
directories rendered as kustomizations of their own), `patches` (RFC 6902 JSON patches
with a kind/name target), then `namespace`, `labels` and `images`. Any other field, or
a feature of these it does not implement, raises: a manifest change that needs more
fails here instead of rendering differently from `kubectl apply -k`.

    python -m tests.kustomize deploy/k8s/overlays/bundled     # prints the YAML
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

FIELDS = {"apiVersion", "kind", "namespace", "resources", "patches", "labels", "images"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole",
                  "ClusterRoleBinding", "CustomResourceDefinition"}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class Unsupported(ValueError):
    """The kustomization uses something this renderer does not implement."""


def render(directory: str | Path) -> list[dict]:
    """The resources `kubectl kustomize DIRECTORY` would print, as dicts, in order."""
    directory = Path(directory)
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - FIELDS
    if unknown:
        raise Unsupported(f"{directory}: kustomization fields {sorted(unknown)}")
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise Unsupported(f"{directory}: kind {spec['kind']!r}")
    resources: list[dict] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            resources += render(path)
        else:
            resources += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for patch in spec.get("patches", []):
        _apply_patch(directory, resources, patch)
    if "namespace" in spec:
        for res in resources:
            if res["kind"] not in CLUSTER_SCOPED:
                res["metadata"]["namespace"] = spec["namespace"]
    for label in spec.get("labels", []):
        _add_labels(resources, label)
    for image in spec.get("images", []):
        _set_image(resources, image)
    return resources


# -- patches ---------------------------------------------------------------------------
def _apply_patch(directory: Path, resources: list[dict], patch: dict) -> None:
    unknown = set(patch) - {"target", "patch", "path"}
    target = patch.get("target") or {}
    if unknown or set(target) - {"kind", "name"} or not target:
        raise Unsupported(f"patch {patch}: only target kind/name with patch or path")
    text = patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()
    ops = yaml.safe_load(text)
    if not isinstance(ops, list):
        raise Unsupported("only JSON 6902 patches (a list of operations)")
    matched = [r for r in resources
               if r["kind"] == target.get("kind", r["kind"])
               and r["metadata"]["name"] == target.get("name", r["metadata"]["name"])]
    if not matched:
        raise ValueError(f"patch target {target} matches no resource")
    for res in matched:
        for op in ops:
            json_patch(res, op)


def json_patch(doc: dict, op: dict) -> None:
    """Apply one RFC 6902 operation (add, replace, remove) to `doc` in place."""
    kind, parts = op["op"], _pointer(op["path"])
    parent = doc
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    if kind == "add":
        value = copy.deepcopy(op["value"])
        if isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else _index(parent, last, 1), value)
        else:
            parent[last] = value
    elif kind == "replace":
        if isinstance(parent, list):
            parent[_index(parent, last)] = copy.deepcopy(op["value"])
        elif last not in parent:
            raise ValueError(f"replace: {op['path']} does not exist")
        else:
            parent[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        if isinstance(parent, list):
            del parent[_index(parent, last)]
        else:
            del parent[last]
    else:
        raise Unsupported(f"JSON patch op {kind!r}")


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(items: list, text: str, extra: int = 0) -> int:
    i = int(text)
    if not 0 <= i < len(items) + extra:
        raise ValueError(f"index {i} outside a list of {len(items)}")
    return i


# -- transformers ----------------------------------------------------------------------
def _add_labels(resources: list[dict], label: dict) -> None:
    if set(label) - {"pairs", "includeSelectors", "includeTemplates"} or \
            label.get("includeSelectors"):
        raise Unsupported(f"labels entry {label}: only pairs (+ includeTemplates)")
    for res in resources:
        res["metadata"].setdefault("labels", {}).update(label["pairs"])
        if label.get("includeTemplates") and res["kind"] in POD_TEMPLATE_KINDS:
            meta = res["spec"]["template"].setdefault("metadata", {})
            meta.setdefault("labels", {}).update(label["pairs"])


def containers(res: dict) -> list[dict]:
    """The containers (init ones first) of a workload's pod template; [] for others."""
    if res["kind"] not in POD_TEMPLATE_KINDS:
        return []
    pod = res["spec"]["template"]["spec"]
    return pod.get("initContainers", []) + pod["containers"]


def _set_image(resources: list[dict], image: dict) -> None:
    if set(image) - {"name", "newName", "newTag"}:
        raise Unsupported(f"images entry {image}: only name, newName, newTag")
    for res in resources:
        for c in containers(res):
            name, _, tag = c["image"].partition(":")
            if name == image["name"]:
                new_tag = image.get("newTag", tag)
                c["image"] = image.get("newName", name) + (f":{new_tag}" if new_tag else "")


if __name__ == "__main__":
    print(yaml.safe_dump_all(render(sys.argv[1]), sort_keys=False), end="")
