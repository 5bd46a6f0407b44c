"""Slow or hung shard locations (real SeaweedFS processes SIGSTOPped) must not turn
healthy objects into misses or slow gets, and scrub --repair must heal what the
stall left behind.

This test lays out its own 12 buckets so that stopping one server hangs exactly
the locations wanted: server 3 holds only location 3, server 2 only location 7,
server 4 only location 4 (all data shards, so every get is affected and must
hedge to parity); servers 0 and 1 hold the other nine. A stopped `weed` keeps its
sockets open: connects succeed (the kernel accepts) and requests hang until the
5 s socket timeout, which is what a rotten volume looked like (issue 18).
"""

import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from kvmesh.s3 import ensure_bucket, s3_client
from kvmesh.services.kvstore.config import KvstoreConfig, ShardLocation
from tests.kvstore.conftest import call, hexkey

SERVER_OF = {0: 0, 1: 1, 2: 0, 3: 3, 4: 4, 5: 1, 6: 0, 7: 2, 8: 1, 9: 0, 10: 1, 11: 0}


@pytest.fixture
def own_layout(cluster):
    tag = f"h{os.getpid() % 10000}x{time.monotonic_ns() % 100000}"
    locs = []
    for i in range(12):
        endpoint = cluster.servers[SERVER_OF[i]].endpoint
        bucket = f"kvh-{tag}-{i:02d}"
        ensure_bucket(s3_client(endpoint), bucket)
        locs.append(ShardLocation(endpoint, bucket))
    return tuple(locs)


@pytest.fixture
def stopper(cluster):
    """SIGSTOP weed servers; every one is SIGCONTed at the end, whatever happens."""
    stopped: list[int] = []

    def stop(server: int) -> None:
        pid = cluster.servers[server].proc.proc.pid
        os.kill(pid, signal.SIGSTOP)
        stopped.append(server)
        # the stop is delivered asynchronously: wait until every thread of the process is
        # stopped, so the next request cannot be answered by a thread still running
        deadline = time.monotonic() + 5.0
        while not _all_stopped(pid):
            assert time.monotonic() < deadline, f"weed server {server} (pid {pid}) did not stop"
            time.sleep(0.005)

    def resume() -> None:
        while stopped:
            os.kill(cluster.servers[stopped.pop()].proc.proc.pid, signal.SIGCONT)

    stop.resume = resume
    yield stop
    resume()


def _all_stopped(pid: int) -> bool:
    """Every thread of `pid` in state T (stopped), read from /proc."""
    tasks = f"/proc/{pid}/task"
    states = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that exited meanwhile
            continue
    return bool(states) and all(s in ("T", "t") for s in states)


@contextmanager
def timed(out: list[float]):
    t0 = time.monotonic()
    yield
    out.append(time.monotonic() - t0)


def quantile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def p99(xs: list[float]) -> float:
    return quantile(xs, 0.99)


def p95(xs: list[float]) -> float:
    return quantile(xs, 0.95)


def gets_for(kv, items, seconds: float, lat: list[float]) -> int:
    """Single-object gets of random stored objects for `seconds`; each must be exact."""
    rng = random.Random(len(lat))
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        key, data = rng.choice(items)
        with timed(lat):
            got = call(kv.address, lambda c, key=key: c.get([key]))
        assert got == [data], f"wrong or missing bytes for {key}"
        n += 1
    return n


def test_hung_locations_hedged_health_by_rate_scrub_repairs(make_server, own_layout, stopper,
                                                             cluster):
    kv = make_server(locations=own_layout, mem_bytes=0, disk_bytes=0, run_blocks=1,
                     s3_give_up_s=KvstoreConfig.s3_give_up_s)  # the default
    items = [(hexkey(900 + i), os.urandom(50_000 + 7919 * i)) for i in range(16)]
    call(kv.address, lambda c: c.put(items))
    warm: list[float] = []
    gets_for(kv, items, 1.0, warm)  # latency samples for the budgets

    # -- 1 location hung (shard 3 of every object) ------------------------------------
    stopper(3)
    first: list[float] = []
    for key, data in items[:3]:
        with timed(first):
            assert call(kv.address, lambda c, key=key: c.get([key])) == [data]
    one: list[float] = []
    n1 = gets_for(kv, items, 3.0, one)
    more = [(hexkey(950 + i), os.urandom(30_000 + i)) for i in range(3)]
    put_s: list[float] = []
    with timed(put_s):  # 11 of 12 shards land; the hung one is not waited for
        call(kv.address, lambda c: c.put(more))
    items += more

    # -- 2 locations hung (shards 3 and 7) -------------------------------------------------
    stopper(2)
    two: list[float] = []
    n2 = gets_for(kv, items, 4.0, two)
    assert kv.core.shards.up_count() >= 10, "slow reads alone must not take locations down"

    # -- 3 locations hung (3, 7, 4): below k, every get is a clean miss -----------------------
    stopper(4)
    three: list[float] = []
    with timed(three):
        got = call(kv.address, lambda c: c.get([k for k, _ in items]))
    hits = [k for (k, _), g in zip(items, got, strict=True) if g is not None]
    # (a flake once served an object here; say enough to tell a stop that did not hold
    # from a read path that got 10 shards some other way)
    held = [(s, cluster.servers[s].endpoint, _all_stopped(cluster.servers[s].proc.proc.pid))
            for s in (2, 3, 4)]
    assert not hits, (f"{len(hits)} of {len(items)} served with 3 locations hung: {hits}; "
                      f"locations up {kv.core.shards.up_count()}, counters "
                      f"{dict(kv.core.counters)}; (server, endpoint, still stopped) {held}")

    # -- all back: scrub --repair heals what the stall left, then all exact ---------------------
    stopper.resume()
    cli = subprocess.run(
        [sys.executable, "-m", "kvmesh.launch.cli", "admin", "--kvstore", kv.address, "scrub", "--repair"],
        capture_output=True, text=True, timeout=60,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    report = call(kv.address, lambda c: c.scrub(repair=False))
    assert (report.objects, report.healthy, report.shards_bad) == (len(items), len(items), 0)
    after: list[float] = []
    with timed(after):
        got = call(kv.address, lambda c: c.get([k for k, _ in items]))
    assert got == [d for _, d in items]

    c = kv.core.counters
    print(f"\n1 hung: first gets {[round(x, 3) for x in first]} s, {n1} gets p99 "
          f"{p99(one):.3f} max {max(one):.3f} s; put of 3 with 1 hung {put_s[0]:.2f} s"
          f"\n2 hung: {n2} gets p99 {p99(two):.3f} max {max(two):.3f} s"
          f"\n3 hung: batch get of {len(items)} -> misses in {three[0]:.2f} s"
          f"\nresumed: batch get exact in {after[0]:.2f} s; warm p99 {p99(warm):.3f} s"
          f"\nscrub --repair: {cli.stdout.strip().splitlines()[-1]}"
          f"\ncounters: hedged {c['shard_reads_hedged']}, timed out {c['shard_reads_timed_out']}, "
          f"repaired {c['shards_repaired']}")
    # A first get that waited for its hung shard would take the 5 s read timeout. How much
    # sooner the hedge answers depends on the machine's load: the hedge delay is 2 x the
    # location's recent p90, taken under whatever else runs. Under the full suite on 2 cores,
    # one first get took 1.57 s; half the timeout still tells a hedge from a wait.
    assert max(first) < 2.5, first
    # Steady state: most gets hedge at once. With ~100 samples a p99 is the single worst get,
    # and under the full suite one get of 96 took 0.67 s (CI, 2 cores): the tail is held to
    # the same half-timeout bound as the first gets, the bulk to 0.5 s.
    assert p95(one) < 0.5 and p95(two) < 0.5, (p95(one), p95(two))
    assert max(one + two) < 2.5, (max(one), max(two))
    assert c["shard_reads_hedged"] > 0
