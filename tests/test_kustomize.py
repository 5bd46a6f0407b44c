"""tests/kustomize.py, the renderer behind tests/test_k8s.py: RFC 6902 and kustomize rules."""

from __future__ import annotations

import pytest
import yaml

from tests.kustomize import Unsupported, json_patch, render


@pytest.mark.parametrize("doc, op, want", [
    # RFC 6902 appendix A.1, A.2, A.3, A.4, A.5, A.16 (same documents and operations)
    ({"foo": "bar"}, {"op": "add", "path": "/baz", "value": "qux"}, {"foo": "bar", "baz": "qux"}),
    ({"foo": ["bar", "baz"]}, {"op": "add", "path": "/foo/1", "value": "qux"},
     {"foo": ["bar", "qux", "baz"]}),
    ({"baz": "qux", "foo": "bar"}, {"op": "remove", "path": "/baz"}, {"foo": "bar"}),
    ({"foo": ["bar", "qux", "baz"]}, {"op": "remove", "path": "/foo/1"}, {"foo": ["bar", "baz"]}),
    ({"baz": "qux", "foo": "bar"}, {"op": "replace", "path": "/baz", "value": "boo"},
     {"baz": "boo", "foo": "bar"}),
    ({"foo": ["bar"]}, {"op": "add", "path": "/foo/-", "value": ["abc", "def"]},
     {"foo": ["bar", ["abc", "def"]]}),
    # A.14: "~1" is "/" in a member name
    ({"/": 9}, {"op": "replace", "path": "/~1", "value": 10}, {"/": 10}),
])
def test_rfc6902_examples(doc, op, want):
    json_patch(doc, op)
    assert doc == want


@pytest.mark.parametrize("doc, op", [
    ({"foo": "bar"}, {"op": "replace", "path": "/baz", "value": 1}),  # A.12-style: absent
    ({"foo": ["bar"]}, {"op": "add", "path": "/foo/2", "value": 1}),  # past the end
    ({"foo": "bar"}, {"op": "remove", "path": "/baz"}),
])
def test_rfc6902_errors(doc, op):
    with pytest.raises((ValueError, KeyError)):
        json_patch(doc, op)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


DEPLOY = """apiVersion: apps/v1
kind: Deployment
metadata: {name: app}
spec:
  template:
    metadata: {labels: {a: b}}
    spec: {containers: [{name: c, image: "img:1"}]}
"""


def test_overlay_patches_then_sets_namespace_labels_and_images(tmp_path):
    write(tmp_path, "base/kustomization.yaml", "resources: [app.yaml]\nnamespace: ns1\n")
    write(tmp_path, "base/app.yaml", DEPLOY)
    write(tmp_path, "over/kustomization.yaml", """
namespace: ns2
labels: [{pairs: {team: x}}]
images: [{name: img, newName: reg/img, newTag: "2"}]
resources: [../base]
patches:
  - target: {kind: Deployment, name: app}
    patch: |-
      - {op: add, path: /spec/replicas, value: 3}
""")
    [d] = render(tmp_path / "over")
    assert d["metadata"] == {"name": "app", "namespace": "ns2", "labels": {"team": "x"}}
    assert d["spec"]["replicas"] == 3
    assert d["spec"]["template"]["metadata"]["labels"] == {"a": "b"}  # templates untouched
    assert d["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/img:2"


def test_images_of_a_base_do_not_reach_overlay_resources(tmp_path):
    """kustomize applies a kustomization's transformers to its own resources only."""
    write(tmp_path, "base/kustomization.yaml",
          "resources: [app.yaml]\nimages: [{name: img, newTag: '9'}]\n")
    write(tmp_path, "base/app.yaml", DEPLOY)
    write(tmp_path, "over/kustomization.yaml", "resources: [../base, extra.yaml]\n")
    write(tmp_path, "over/extra.yaml", DEPLOY.replace("name: app", "name: extra"))
    images = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["image"]
              for d in render(tmp_path / "over")}
    assert images == {"app": "img:9", "extra": "img:1"}


@pytest.mark.parametrize("kustomization", [
    {"resources": ["app.yaml"], "namePrefix": "x-"},
    {"resources": ["app.yaml"], "labels": [{"pairs": {"a": "b"}, "includeSelectors": True}]},
    {"resources": ["app.yaml"], "patches": [{"path": "p.yaml"}]},  # no target
    {"resources": ["app.yaml"],  # a strategic-merge patch
     "patches": [{"target": {"kind": "Deployment"}, "patch": "spec: {replicas: 2}"}]},
])
def test_unimplemented_features_raise(tmp_path, kustomization):
    write(tmp_path, "kustomization.yaml", yaml.safe_dump(kustomization))
    write(tmp_path, "app.yaml", DEPLOY)
    with pytest.raises(Unsupported):
        render(tmp_path)


def test_a_patch_that_matches_nothing_raises(tmp_path):
    write(tmp_path, "kustomization.yaml", "resources: [app.yaml]\npatches:\n"
          "  - target: {kind: Deployment, name: other}\n    patch: '[]'\n")
    write(tmp_path, "app.yaml", DEPLOY)
    with pytest.raises(ValueError, match="matches no resource"):
        render(tmp_path)
