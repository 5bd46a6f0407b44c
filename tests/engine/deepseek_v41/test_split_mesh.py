"""A mesh of two DeepSeek V4.1 engines, each split over 2 gloo ranks (`kvmesh up
--tensor-parallel 2`'s processes: real SeaweedFS, Valkey, kvstore, directory and gateway):
one engine's blocks written through to the kvstore and its snapshot fetched by the other
make the other's hit, equal to the reference's greedy tokens; the gateway serves Generate
from a split engine. (Bounded replay on a split engine: tests/engine/deepseek_v4/
test_split_serve.py.)"""

from __future__ import annotations

import grpc
import pytest

from kvmesh.launch.mesh import Mesh, MeshConfig
from kvmesh.proto import gateway_pb2_grpc
from kvmesh.services.gateway.client import gateway_request
from tests.engine.deepseek_v4.test_mesh import _served_after_the_other, _stats
from tests.engine.deepseek_v41.test_engine import greedy, random_prompt
from tests.engine.deepseek_v41.test_mesh import TRUNCATION, _checkpoint


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-v41-split")
    m41 = _checkpoint(directory)
    cfg = MeshConfig(log_dir=tmp_path_factory.mktemp("split-mesh") / "logs", engines=2,
                     num_slots=4, num_blocks=64, model=str(directory), tensor_parallel=2,
                     engine_extra=("--dtype", "float64", "--fetch-deadline-ms", "5000",
                                   "--swa-fetch", "always", *TRUNCATION))
    m = Mesh(cfg).start()
    try:
        yield m, m41
    finally:
        m.stop()


def test_split_engines_share_blocks_and_snapshots_through_the_mesh(mesh):
    m, m41 = mesh
    first = random_prompt(300, seed=51)
    second = first[:256] + random_prompt(40, seed=52)
    ids, last, b = _served_after_the_other(m, first, second, 12)
    assert ids == greedy(m41, second, 12, keep=134)
    s = _stats(b)
    assert (s["block_hits_remote"], s["snapshot_hits"], s["peer_snapshot_fetches"]) == (1, 1, 1), \
        {k: v for k, v in s.items() if v}
    assert last.usage.cached_tokens == 128


def test_the_gateway_serves_generate_from_split_engines(mesh):
    m, m41 = mesh
    prompt = random_prompt(150, seed=53)
    with grpc.insecure_channel(m.gateway) as channel:
        reply = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
            gateway_request(prompt, max_tokens=8, temperature=0.0, ignore_eos=True), timeout=120)
    assert list(reply.token_ids) == greedy(m41, prompt, 8, keep=134)
