"""Typed async client for GatewayService.

    async with GatewayClient("127.0.0.1:7000") as gw:
        async for msg in gw.stream("Hello", max_tokens=32, temperature=0):
            print(msg.text, end="")
        resp = await gw.generate([72, 105], max_tokens=8)   # token ids work too

Errors arrive as grpc.aio.AioRpcError with the gateway's status and message
(INVALID_ARGUMENT names the field). The client owns its channel; `close()` it. Against a
gateway with API keys on, give `api_key=` or set $KVMESH_API_KEY.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from kvmesh.generation import set_sampling, traffic_class_to_proto
from kvmesh.proto import gateway_pb2 as pb
from kvmesh.proto import gateway_pb2_grpc as pb_grpc
from kvmesh.rpc import RpcClient


def gateway_request(prompt: str | list[int], max_tokens: int | None = None,
                    temperature: float | None = None, top_k: int | None = None,
                    top_p: float | None = None, seed: int | None = None,
                    stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
                    traffic_class: str = "", cache_salt: str = "", request_id: str = "",
                    ignore_eos: bool = False, **controls: float | None) -> pb.GenerateRequest:
    """`controls`: kvmesh.generation.SAMPLING_CONTROLS by name (min_p, penalties)."""
    req = pb.GenerateRequest(request_id=request_id, cache_salt=cache_salt,
                             traffic_class=traffic_class_to_proto(traffic_class), ignore_eos=ignore_eos,
                             stop=stop or [], stop_token_ids=stop_token_ids or [])
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(prompt)
    return set_sampling(req, max_tokens, temperature, top_k, top_p, seed, **controls)


API_KEY_ENV = "KVMESH_API_KEY"


class GatewayClient(RpcClient):
    """`api_key`: sent as `authorization: Bearer <key>` on every call, for a gateway with
    API keys on (--api-keys); None reads $KVMESH_API_KEY, "" sends none."""

    def __init__(self, address: str, api_key: str | None = None):
        super().__init__(address, pb_grpc.GatewayServiceStub)
        key = os.environ.get(API_KEY_ENV, "") if api_key is None else api_key
        self.metadata = (("authorization", f"Bearer {key}"),) if key else None

    async def stream(self, prompt, timeout: float | None = None, **kw
                     ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async for msg in self.stub.GenerateStream(gateway_request(prompt, **kw), timeout=timeout,
                                                  metadata=self.metadata):
            yield msg

    async def generate(self, prompt, timeout: float | None = None, **kw) -> pb.GenerateResponse:
        return await self.stub.Generate(gateway_request(prompt, **kw), timeout=timeout,
                                        metadata=self.metadata)
