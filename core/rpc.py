"""gRPC plumbing shared by every service: servers with auth, health and reflection; channels with deadlines."""
from __future__ import annotations

import hmac
import inspect

import grpc
from grpc import aio

HEALTH_PREFIX = "/grpc.health.v1.Health/"
# The health methods that need no token: one-shot answers. Watch is not among them: a stream held open for as long as
# the caller likes, one per service name it makes up, is a way for anyone who can reach the port to hold its memory.
OPEN_HEALTH = frozenset({HEALTH_PREFIX + "Check", HEALTH_PREFIX + "List"})
CONTROL_PREFIX = "/tars.v1.ControlService/"
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})
MAX_DETAILS = 1024   # bytes of a status message a server sends (they travel in a header: see clip_details)
# A server closes a connection that has carried no call for CONN_IDLE_S (a GOAWAY: a client's channel reconnects on its
# next call), and one that has not finished the HTTP/2 handshake in HANDSHAKE_S. Without them a peer that connects and
# never sends (no token needed) held its connection, and a file descriptor, for ever: enough of them and the server
# could accept nobody.
CONN_IDLE_S = 120.0
HANDSHAKE_S = 10.0


def clip_details(text: str, limit: int = MAX_DETAILS) -> str:
    """A status message cut to `limit` UTF-8 bytes, with a note of what was cut. The message travels
    percent-encoded in the grpc-message trailer; past the peer's metadata limit (8-16 KiB) the call fails with
    RESOURCE_EXHAUSTED instead of its own code, so a message echoing a long client-written field (an action's target,
    unknown option names) must be cut before it is sent."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    return raw[:limit].decode(errors="ignore") + f" [... {len(raw) - limit} more bytes]"


def _options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


class TokenAuthInterceptor(aio.ServerInterceptor):
    """Rejects every RPC that lacks `authorization: Bearer <token>`, except grpc.health.v1 Check and List.

    control_token, when not None, is the token of the ControlService methods on this listener instead ("" = they
    need none): control.auth_token guards every process's ControlService, whatever service shares its port.
    """

    def __init__(self, token: str, control_token: str | None = None):
        self._want = f"Bearer {token}" if token else None
        self._want_control = self._want if control_token is None else (f"Bearer {control_token}" if control_token else None)

        async def deny(request_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        # Request-streaming handlers that never read: the call is refused on its headers, before any of its body
        # (up to max_message_bytes, 512 MiB on the inference server) is received and buffered.
        self._deny = grpc.stream_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        want = self._want_control if method.startswith(CONTROL_PREFIX) else self._want
        md = dict(handler_call_details.invocation_metadata or ())
        # Health checks carry no secrets and orchestrators' probes (Kubernetes gRPC probes) cannot send a token.
        if want is None or _same(md.get("authorization"), want) or method in OPEN_HEALTH:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny


def _same(got, want: str) -> bool:
    """Constant-time comparison of the presented header with the expected one."""
    return isinstance(got, str) and hmac.compare_digest(got.encode(), want.encode())


class _BadRequest:
    def __init__(self, why: str):
        self.why = why


def _guarded(deserialize):
    def d(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # protobuf DecodeError and friends: bytes that are not the request message
            return _BadRequest(f"{type(e).__name__}: {e}"[:200])
    return d


class RequestDecodeInterceptor(aio.ServerInterceptor):
    """Bytes that do not parse as the request message get INVALID_ARGUMENT (gRPC's own answer is UNKNOWN, which
    reads like a server bug). Wraps unary-request handlers once per method; streaming requests are left alone."""

    def __init__(self):
        self._cache: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        h = await continuation(handler_call_details)
        if h is None or h.request_streaming or h.request_deserializer is None:
            return h
        cached = self._cache.get(method)
        if cached is not None and getattr(cached, "_orig", None) is h:
            return cached
        if h.response_streaming:
            if not inspect.isasyncgenfunction(h.unary_stream):
                return h  # a handler that writes with context.write cannot be wrapped by an async generator

            async def stream(req, ctx, _beh=h.unary_stream):
                if isinstance(req, _BadRequest):
                    await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {req.why}")
                async for x in _beh(req, ctx):
                    yield x
            w = grpc.unary_stream_rpc_method_handler(stream, _guarded(h.request_deserializer), h.response_serializer)
        else:
            async def unary(req, ctx, _beh=h.unary_unary):
                if isinstance(req, _BadRequest):
                    await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {req.why}")
                r = _beh(req, ctx)
                return (await r) if inspect.isawaitable(r) else r
            w = grpc.unary_unary_rpc_method_handler(unary, _guarded(h.request_deserializer), h.response_serializer)
        w._orig = h
        self._cache[method] = w
        return w


def make_server(max_message_bytes: int = 16 << 20, auth_token: str = "", control_token: str | None = None) -> aio.Server:
    """auth_token guards every RPC; control_token (when not None) the ControlService's instead (TokenAuthInterceptor)."""
    auth = auth_token or control_token
    interceptors = ([TokenAuthInterceptor(auth_token, control_token)] if auth else []) + [RequestDecodeInterceptor()]
    return aio.server(interceptors=interceptors, options=_options(max_message_bytes) + [
        ("grpc.max_connection_idle_ms", max(1, int(CONN_IDLE_S * 1000))),
        ("grpc.server_handshake_timeout_ms", max(1, int(HANDSHAKE_S * 1000)))])


def add_health_and_reflection(server: aio.Server, service_names: list[str]):
    """Serve grpc.health.v1 (all names SERVING) and reflection, so grpcurl and k8s probes work."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    hs = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    return hs, health_pb2


async def set_serving(hs, health_pb2, names: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for n in ["", *names]:
        r = hs.set(n, status)
        if hasattr(r, "__await__"):
            await r


def bind(server: aio.Server, host: str, port: int, setting: str = "") -> int:
    """Bind host:port (port 0 = any free port) and return the port actually bound. One that cannot be bound (in use,
    an address not of this host) is a core.config.UserError naming `setting`: one line and exit 2 from `tars`."""
    from core.config import UserError

    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio >= 1.60 raises "Failed to bind to address" instead of returning 0
        bound = 0
    if bound == 0:
        raise UserError(f"cannot bind {host}:{port}{f' ({setting})' if setting else ''}: the port is in use or the "
                        "address is not one of this host's; choose another port, or 0 for any free one")
    return bound


def channel(address: str, auth_token: str = "", max_message_bytes: int = 16 << 20) -> aio.Channel:
    """An asyncio channel; with a token, every call carries the bearer header; with tracing on (core.telemetry),
    every call carries the caller's span as W3C `traceparent` metadata."""
    from core import telemetry

    opts = _options(max_message_bytes)
    bearer = _bearer(auth_token)
    interceptors = ((_adding(lambda: bearer) if auth_token else [])  # the trace entry: the caller's span, in its task
                    + (_adding(telemetry.grpc_metadata) if telemetry.S.tracing else []))
    if not interceptors:
        return aio.insecure_channel(address, options=opts)  # no interceptor machinery on the hot path
    return aio.insecure_channel(address, options=opts, interceptors=interceptors)


def sync_channel(address: str, auth_token: str = "", max_message_bytes: int = 16 << 20) -> grpc.Channel:
    ch = grpc.insecure_channel(address, options=_options(max_message_bytes))
    if auth_token:
        ch = grpc.intercept_channel(ch, _SyncClientAuth(auth_token))
    return ch


class _Details:
    def __init__(self, d, md):
        self.method, self.timeout, self.metadata = d.method, d.timeout, md
        self.credentials = getattr(d, "credentials", None)
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


def _bearer(token: str) -> list[tuple[str, str]]:
    """The metadata entry a call presents its token in (TokenAuthInterceptor reads it)."""
    return [("authorization", f"Bearer {token}")]


def _with(details, extra: list) -> "_Details | object":
    return _Details(details, list(details.metadata or ()) + extra) if extra else details


class _Adding:
    def __init__(self, extra):
        self.extra = extra  # () -> metadata entries to add to every call


class _UnaryUnary(_Adding, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with(details, self.extra()), request)


class _UnaryStream(_Adding, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with(details, self.extra()), request)


class _StreamUnary(_Adding, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with(details, self.extra()), request_iterator)


class _StreamStream(_Adding, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with(details, self.extra()), request_iterator)


def _adding(extra) -> list:
    """Interceptors that add extra() to the metadata of every call, one per call kind: grpc.aio files an interceptor
    under the first kind it implements only, so one object for all four would leave streaming calls without it."""
    return [cls(extra) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


class _SyncClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                      grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The bearer header on every call of a blocking channel (grpc.intercept_channel serves each kind an
    interceptor implements)."""

    def __init__(self, token: str):
        self.bearer = _bearer(token)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with(details, self.bearer), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with(details, self.bearer), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_with(details, self.bearer), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_with(details, self.bearer), request_iterator)
