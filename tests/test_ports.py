"""free_port hands out ports the kernel will not give to anyone else by itself;
a weed that loses a port anyway is caught at once."""

from __future__ import annotations

import socket

from kvmesh.launch.backing import proc


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    span = proc._pick_range()
    assert span is not None, "this machine's ephemeral range starts below 11000"
    lo, hi = span
    ports = [proc.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    assert all(lo <= p < hi for p in ports), (lo, hi, min(ports), max(ports))
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_listening_port_is_skipped():
    port = proc.free_port()
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", port))
        held.listen()
        proc._next_port = port          # the walk comes back to it
        assert proc.free_port() != port


def test_the_walk_wraps_at_the_top_of_the_range():
    lo, hi = proc._pick_range()
    proc._next_port = hi - 1
    got = [proc.free_port() for _ in range(2)]
    assert got[0] in (hi - 1, lo) and lo <= got[1] < lo + 5, got


def test_weed_that_loses_its_s3_port_is_killed_and_reported(tmp_path):
    """weed logs a fatal bind error but may live a minute more: wait_ready reads the log,
    kills it and raises PortTaken, which the cluster start retries on fresh ports."""
    import threading
    import time

    import pytest

    from kvmesh.launch.backing.seaweed import PortTaken, SeaweedServer

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()

        def refuse():  # answer nothing: each probe fails at once rather than timing out
            while True:
                try:
                    held.accept()[0].close()
                except OSError:
                    return
        threading.Thread(target=refuse, daemon=True).start()
        weed = SeaweedServer(tmp_path, ports={"s3": held.getsockname()[1]}).start()
        t0 = time.monotonic()
        try:
            with pytest.raises(PortTaken, match="address already in use"):
                weed.wait_ready(["kvmesh-probe"], timeout=60)
        finally:
            weed.stop()
        assert not weed.alive
        assert time.monotonic() - t0 < 30
