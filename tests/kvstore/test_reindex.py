"""The index survives the node: a kvstore whose data dir (sqlite index, disk tier) is
gone rebuilds it from the manifests in the shards (`kvmesh admin reindex`)."""

import os
import shutil
import subprocess
import sys

from kvmesh.services.kvstore.config import DAY
from kvmesh.services.kvstore.shards import RUN_PREFIX
from tests.kvstore.conftest import call, hexkey


def kvmesh_admin(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "admin", "--kvstore", address,
                           *args], capture_output=True, text=True, timeout=120)


def test_lost_index_rebuilt_by_reindex_then_gc_honours_ttl_classes(make_server, clock, tmp_path):
    first = make_server(data_dir=tmp_path / "a", mem_bytes=0, disk_bytes=0)
    agent = [(hexkey(1000 + i), os.urandom(20_000 + i)) for i in range(16)]
    chat = [(hexkey(2000 + i), os.urandom(30_000 + i)) for i in range(4)]
    single = [(hexkey(3000), os.urandom(5_000))]
    call(first.address, lambda c: c.put(agent, traffic_class="agent"))
    clock.advance(60)
    call(first.address, lambda c: c.put(chat, traffic_class="chatbot"))
    call(first.address, lambda c: c.put(single, traffic_class="agent"))
    clock.advance(60)
    newer = [(agent[0][0], b"newer version"), (agent[1][0], os.urandom(999))]
    call(first.address, lambda c: c.put(newer, traffic_class="agent"))
    agent[:2] = newer  # the newest version of a key must win the reindex
    everything = agent + chat + single
    first.stop()
    shutil.rmtree(tmp_path / "a")

    fresh = make_server(data_dir=tmp_path / "b", mem_bytes=0, disk_bytes=0)
    keys = [k for k, _ in everything]
    assert call(fresh.address, lambda c: c.get(keys)) == [None] * len(keys)
    cli = kvmesh_admin(fresh.address, "reindex")
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "found 1 objects and 3 runs holding 21 blocks; 21 index records restored" in \
        " ".join(cli.stdout.split())
    assert call(fresh.address, lambda c: c.get(keys)) == [d for _, d in everything]
    meta = fresh.core.meta
    assert {meta.get(k).traffic_class for k, _ in agent + single} == {"agent"}
    assert {meta.get(k).traffic_class for k, _ in chat} == {"chatbot"}
    assert {meta.get(k).run for k, _ in agent[:2]} == {meta.get(agent[0][0]).run}
    assert again_is_a_no_op(fresh)

    clock.advance(3.5 * DAY)  # past agent's 3-day TTL, within chatbot's 7 days
    report = call(fresh.address, lambda c: c.run_gc())
    assert sorted(report.expired) == sorted(k for k, _ in agent + single)
    assert call(fresh.address, lambda c: c.get(keys)) == \
        [None] * (len(agent)) + [d for _, d in chat] + [None]
    chat_run = meta.get(chat[0][0]).run
    listed = [sorted(s.key for s in fresh.call(fresh.core.shards.list(i, RUN_PREFIX)))
              for i in range(12)]
    assert listed == [[chat_run]] * 12  # the agent runs went with their last blocks


def again_is_a_no_op(kv) -> bool:
    report = call(kv.address, lambda c: c.reindex())
    return (report.runs, report.objects, report.restored, list(report.unreadable)) == (3, 1, 0, [])
