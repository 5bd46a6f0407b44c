"""Typed async client for EngineService."""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvmesh.generation import set_sampling, traffic_class_to_proto
from kvmesh.proto import engine_pb2, engine_pb2_grpc
from kvmesh.rpc import RpcClient


def generate_request(prompt: str | list[int], max_tokens: int | None = None,
                     temperature: float | None = None, top_k: int | None = None,
                     top_p: float | None = None, seed: int | None = None,
                     stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
                     cache_salt: str = "", traffic_class: str | int = "", request_id: str = "",
                     ignore_eos: bool = False, speculative: str | None = None,
                     **controls: float | None) -> engine_pb2.GenerateRequest:
    """`traffic_class`: a name ("agent", "chatbot", "" = none) or a common.v1 TrafficClass
    number as is (the engine rejects numbers outside the enum); `controls`:
    kvmesh.generation.SAMPLING_CONTROLS by name (min_p, penalties)."""
    if isinstance(traffic_class, str):
        traffic_class = traffic_class_to_proto(traffic_class)
    req = engine_pb2.GenerateRequest(request_id=request_id, cache_salt=cache_salt,
                                     traffic_class=traffic_class, ignore_eos=ignore_eos,
                                     stop=stop or [], stop_token_ids=stop_token_ids or [])
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(prompt)
    return set_sampling(req, max_tokens, temperature, top_k, top_p, seed, speculative, **controls)


class EngineClient(RpcClient):
    def __init__(self, address: str):
        super().__init__(address, engine_pb2_grpc.EngineServiceStub)

    async def generate(self, prompt, timeout: float | None = None, **kw
                       ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        async for msg in self.stub.Generate(generate_request(prompt, **kw), timeout=timeout):
            yield msg

    async def complete(self, prompt, timeout: float | None = None, **kw):
        """Collect a whole generation: (token ids, text, last message)."""
        ids, text, last = [], "", None
        async for msg in self.generate(prompt, timeout=timeout, **kw):
            ids.extend(msg.token_ids)
            text += msg.text
            last = msg
        return ids, text, last

    async def stats(self) -> dict[str, float]:
        return dict((await self.stub.GetStats(engine_pb2.GetStatsRequest())).counters)

    async def model_info(self):
        return await self.stub.GetModelInfo(engine_pb2.GetModelInfoRequest())

