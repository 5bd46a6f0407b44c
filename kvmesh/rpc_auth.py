"""The service and admin tokens on gRPC: `TokenGuard` (server side) and
`token_interceptors` (client side). kvmesh/rpc.py installs them on every internal
server and channel when a token is configured; kvmesh/auth.py says which token is which.
Clients send a per-call proof of the token, never the token (kvmesh/rpc_proof.py);
servers take a proof or `Bearer <token>`.
"""

from __future__ import annotations

import grpc

from kvmesh import auth
from kvmesh.rpc_proof import ProofCheck, prove

# RPCs that take the admin token instead of the service token.
ADMIN_METHODS = frozenset(f"/kvmesh.kvstore.v1.KvstoreService/{m}"
                          for m in ("Delete", "RunGC", "Scrub", "Reindex"))
# Always open: liveness probes and grpcurl's schema discovery carry no secrets.
OPEN_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


_CODE = {auth.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
         auth.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED}


class TokenGuard(grpc.aio.ServerInterceptor):
    """Server interceptor: every call but health/reflection must carry the service token
    (`ADMIN_METHODS`: the admin token), as a proof of it (`Kvmesh-Proof ...`, what kvmesh's
    clients send) or as `authorization: Bearer <token>`.

    A refused call gets a handler of the same kind that only aborts, so the servicer
    never runs and the status is UNAUTHENTICATED (missing) or PERMISSION_DENIED (wrong).
    """

    def __init__(self, service_token: str, admin_token: str = ""):
        self.service_token = service_token
        self.admin_token = admin_token
        self.proofs = ProofCheck()

    async def intercept_service(self, continuation, details):
        method = details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        admin = method in ADMIN_METHODS
        expected, what = ((self.admin_token, "admin token") if admin
                          else (self.service_token, "service token"))
        value = auth.metadata_value(details.invocation_metadata, "authorization")
        try:
            if admin and not expected:
                raise auth.PermissionDenied(f"{method} needs KVMESH_ADMIN_TOKEN, which this "
                                            "server does not have: admin RPCs are off")
            if ProofCheck.is_proof(value):
                why = self.proofs.verify(value, method, expected)
                if why is not None:
                    raise auth.PermissionDenied(f"{what}: {why}")
            else:
                auth.check_token(auth.bearer(value), expected, what)
        except (auth.Unauthenticated, auth.PermissionDenied) as exc:
            handler = await continuation(details)
            return _refusing(handler, _CODE[type(exc)], f"{method}: {exc}")
        return await continuation(details)


def _refusing(handler, code: grpc.StatusCode, message: str):
    async def refuse(request, context):
        await context.abort(code, message)

    async def refuse_stream(request, context):
        await context.abort(code, message)
        yield  # never reached: makes this an async generator

    if handler is None:
        return None
    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **kw)


class _BearerDetails(grpc.aio.ClientCallDetails):
    pass


class _SendToken:
    """Adds `authorization: Kvmesh-Proof ...`, a proof of the token for this one call (the
    admin token on `ADMIN_METHODS` when one is known), unless the call already carries an
    `authorization`. grpc.aio files each interceptor object under one call kind only, so
    `token_interceptors` makes one per kind."""

    def __init__(self, service_token: str, admin_token: str = ""):
        self.service_token = service_token
        self.admin_token = admin_token

    def _details(self, d):
        method = d.method if isinstance(d.method, str) else d.method.decode()
        token = (self.admin_token if method in ADMIN_METHODS and self.admin_token
                 else self.service_token)
        md = list(d.metadata or ())
        if token and not any(k == "authorization" for k, _ in md):
            md.append(("authorization", prove(token, method)))
        return _BearerDetails(d.method, d.timeout, grpc.aio.Metadata(*md), d.credentials,
                              d.wait_for_ready)


class _UnaryUnary(_SendToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_SendToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_SendToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_SendToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def token_interceptors(service_token: str, admin_token: str = "") -> list:
    """Client interceptors (one per call kind) that send proofs of the tokens."""
    return [cls(service_token, admin_token)
            for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
