"""Hostile and careless clients against a real mesh (one mesh for the module).

Undecodable requests: every string field of every request message of every service,
public and internal, set to invalid UTF-8 on the wire, gets INVALID_ARGUMENT. The table
is built from the proto descriptors, so a new field or method is covered without edits.

Cancellation storms: 200 streams are cancelled at random moments (before admission, while queued for a slot,
during prefill, mid-decode) while other streams run beside them. The cancelled ones must end
CANCELLED at the client, every other stream OK with all its tokens, the engines must return
to 0 slots and 0 blocks in use, and no service may log a traceback.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from google.protobuf import descriptor, message_factory

from kvmesh.proto import gateway_pb2_grpc
from kvmesh.services.gateway.client import gateway_request
from tests.gateway import rpc_table
from tests.gateway.conftest import wait_for

CANCELLED, BYSTANDERS = 200, 12
BYSTANDER_TOKENS = 48


def log_sizes(mesh) -> dict[str, int]:
    return {name: p.log_path.stat().st_size for name, p in mesh.procs.items()}


def new_log_text(mesh, since: dict[str, int]) -> dict[str, str]:
    out = {}
    for name, p in mesh.procs.items():
        with open(p.log_path, "rb") as f:
            f.seek(since.get(name, 0))
            out[name] = f.read().decode(errors="replace")
    return out


async def _stream(stub, prompt: str, max_tokens: int, cancel_after: float | None):
    """Run one stream; cancel it after `cancel_after` seconds. Returns (status, tokens)."""
    call = stub.GenerateStream(gateway_request(prompt, max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True), timeout=120)
    tokens: list[int] = []

    async def consume():
        async for msg in call:
            tokens.extend(msg.token_ids)

    task = asyncio.create_task(consume())
    try:
        if cancel_after is None:
            await task
        else:
            done, _ = await asyncio.wait({task}, timeout=cancel_after)
            if not done:
                call.cancel()
            await task
        return "OK", tokens
    except asyncio.CancelledError:  # grpc.aio raises this for a call we cancelled
        return "CANCELLED", tokens
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}", tokens


async def storm(address: str, seed: int):
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        # Bystanders share prefixes with the storm so their blocks are touched by it too.
        jobs = [_stream(stub, f"bystander {i} shares a prefix with the storm " * 3,
                        BYSTANDER_TOKENS, None) for i in range(BYSTANDERS)]
        for i in range(CANCELLED):
            prompt = f"storm {i % 7} shares a prefix with the storm " * rng.randint(1, 30)
            # 0 s cancels before the gateway admits it; later times land in the engine's
            # queue, prefill and decode.
            jobs.append(_stream(stub, prompt, 200, rng.choice([0.0, rng.uniform(0, 2.5)])))
        return await asyncio.gather(*jobs)


@pytest.mark.parametrize("round_", range(2))
def test_cancel_storm_leaves_bystanders_untouched(mesh, gw, round_):
    since = log_sizes(mesh)
    results = asyncio.run(storm(mesh.gateway, seed=round_))
    bystanders, cancelled = results[:BYSTANDERS], results[BYSTANDERS:]
    assert [s for s, _ in bystanders] == ["OK"] * BYSTANDERS
    assert all(len(t) == BYSTANDER_TOKENS for _, t in bystanders)
    # A storm stream either was cancelled or (rarely, if it finished first) is OK.
    bad = [s for s, _ in cancelled if s not in ("CANCELLED", "OK")]
    assert not bad, bad[:5]
    assert sum(s == "CANCELLED" for s, _ in cancelled) > CANCELLED // 2

    def idle():
        stats = [gw.engine_stats(name) for name in mesh.engine_names]
        return all(s["slots_in_use"] == 0 and s["blocks_in_use"] == 0 and s["running"] == 0
                   and s["waiting"] == 0 for s in stats) and stats

    assert wait_for(idle, timeout=30), [gw.engine_stats(n) for n in mesh.engine_names]
    logs = new_log_text(mesh, since)
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name} logged a traceback:\n{text[-3000:]}"
        assert "engine step failed" not in text, f"{name}:\n{text[-3000:]}"


# --- undecodable requests ------------------------------------------------------------
MARK = "\x01utf8-probe\x01"            # serialized once, then overwritten on the wire
FD = descriptor.FieldDescriptor


def _string_paths(msg: descriptor.Descriptor, prefix=(), depth=0):
    for f in msg.fields:
        if f.type == FD.TYPE_STRING:
            yield prefix + (f,)
        elif f.type == FD.TYPE_MESSAGE and depth < 4:
            entry = f.message_type
            if entry.GetOptions().map_entry:
                if entry.fields_by_name["key"].type == FD.TYPE_STRING:
                    yield prefix + (f,)
            else:
                yield from _string_paths(entry, prefix + (f,), depth + 1)


def _bad_bytes(msg_desc, path) -> bytes:
    cls = message_factory.GetMessageClass(msg_desc)
    root = node = cls()
    for f in path[:-1]:
        child = getattr(node, f.name)
        node = child.add() if f.is_repeated else child
    last = path[-1]
    if last.type == FD.TYPE_MESSAGE:                      # a map with string keys
        value = last.message_type.fields_by_name["value"]
        getattr(node, last.name)[MARK] = "" if value.type == FD.TYPE_STRING else 0
    elif last.is_repeated:
        getattr(node, last.name).append(MARK)
    else:
        setattr(node, last.name, MARK)
    raw = root.SerializeToString()
    mark = MARK.encode()
    assert raw.count(mark) == 1
    return raw.replace(mark, b"\xff" * len(mark))


CASES = [(svc, m, path) for svc in rpc_table.services() for m in svc.methods
         for path in _string_paths(m.input_type)]


def test_every_service_has_string_cases():
    covered = {svc.full_name for svc, _, _ in CASES}
    assert covered == {svc.full_name for svc in rpc_table.services()}, covered
    # 29: the engine and kvstore traffic_class fields are common.v1 enums, no longer strings
    assert len(CASES) >= 29


@pytest.mark.parametrize("svc,method,path", CASES,
                         ids=[f"{s.name}.{m.name}.{'.'.join(f.name for f in p)}"
                              for s, m, p in CASES])
def test_invalid_utf8_is_invalid_argument(mesh, channels, svc, method, path):
    raw = _bad_bytes(method.input_type, path)
    with pytest.raises(grpc.RpcError) as info:
        rpc_table.raw_call(channels, mesh, svc, method, raw)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "UTF-8" in info.value.details() and method.name in info.value.details()


# --- last: kills an engine ------------------------------------------------------------
def test_migration_with_truncation_completes_the_stream(mesh, gw):
    """Engines here run YOCO truncation (compact), where a cold prefill of prompt +
    generated tokens is an approximation of the decode that produced them: the stream
    must still complete, with every token, and report the migration."""
    call = gw.stream("truncation on, then a migration " * 8, timeout=120, max_tokens=160,
                     temperature=0.0, ignore_eos=True)
    msgs = [next(call), next(call)]

    def serving():
        return next((n for n in mesh.engine_names
                     if gw.engine_stats(n).get("running", 0) >= 1), None)

    victim = wait_for(serving)
    assert victim
    try:
        mesh.kill(victim)
        msgs += list(call)
    finally:
        mesh.restart(victim)
    assert sum(len(m.token_ids) for m in msgs) == 160
    assert msgs[-1].migrations == 1 and msgs[-1].usage.generated_tokens == 160
