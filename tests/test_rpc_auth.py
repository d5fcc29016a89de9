"""TokenAuthInterceptor as an attacker sees it: a call without the token (or with another role's) is refused on its
headers, before the server receives its body."""
import asyncio

import grpc
from grpc import aio

from core import rpc
from core.v1 import inference_pb2 as ipb, inference_pb2_grpc as ig

U = grpc.StatusCode.UNAUTHENTICATED


class _Svc(ig.InferenceServiceServicer):
    async def Generate(self, req, ctx):
        return ipb.GenerateResponse(output_ids=[7])

    async def GenerateStream(self, req, ctx):
        yield ipb.GenerateChunk()

    async def UpdateWeightsStream(self, it, ctx):
        async for _ in it:
            pass
        return ipb.UpdateWeightsResponse()


async def _with_server(fn, max_message_bytes=1 << 20):
    s = rpc.make_server(max_message_bytes, auth_token="svc-token", control_token="ctl-token")
    ig.add_InferenceServiceServicer_to_server(_Svc(), s)
    port = rpc.bind(s, "127.0.0.1", 0)
    await s.start()
    try:
        return await fn(f"127.0.0.1:{port}")
    finally:
        await s.stop(0)


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def test_a_call_without_the_token_is_refused_before_its_body_is_read():
    # A 2 MiB request to a server that accepts 1 MiB: read first, it would be RESOURCE_EXHAUSTED (the server
    # buffered the body of a caller it was going to refuse: up to 512 MiB a call on the inference server).
    async def go(addr):
        big = ipb.GenerateRequest(trajectory_id="x" * (2 << 20))
        codes = []
        for token in ("", "wrong", "ctl-token"):  # none, a wrong one, another role's
            async with rpc.channel(addr, token, 64 << 20) as ch:
                codes.append(await _code(ig.InferenceServiceStub(ch).Generate(big, timeout=10)))
        return codes
    assert asyncio.run(_with_server(go)) == [U, U, U]


def test_every_kind_of_call_is_refused_without_the_token_and_served_with_it():
    async def go(addr):
        async def chunks():
            for _ in range(3):
                yield ipb.WeightsChunk()

        async def stream(stub):
            async for _ in stub.GenerateStream(ipb.GenerateRequest(), timeout=10):
                pass
        out = {}
        for token in ("", "svc-token"):
            async with rpc.channel(addr, token) as ch:
                stub = ig.InferenceServiceStub(ch)
                out[token] = [await _code(stub.Generate(ipb.GenerateRequest(), timeout=10)),
                              await _code(stream(stub)),
                              await _code(stub.UpdateWeightsStream(chunks(), timeout=10))]
        return out
    out = asyncio.run(_with_server(go))
    assert out[""] == [U, U, U]
    assert out["svc-token"] == [grpc.StatusCode.OK] * 3


def test_health_check_needs_no_token_but_a_health_watch_does():
    """Kubernetes probes call Check without metadata; Watch holds a stream open (one per made-up service name), so
    without the token it was a way to hold the server's memory: 3,000 such streams took 70 MB of a server."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def go(addr):
        out = {}
        for token in ("", "svc-token"):
            async with rpc.channel(addr, token) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                check = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                call = stub.Watch(health_pb2.HealthCheckRequest(service="made-up"), timeout=10)
                try:
                    first = (await call.read()).status
                except grpc.RpcError as e:
                    first = e.code()
                call.cancel()
                out[token] = (check.status, first)
        return out

    async def with_health(addr_fn):
        s = rpc.make_server(1 << 20, auth_token="svc-token", control_token="ctl-token")
        hs, hp = rpc.add_health_and_reflection(s, ["tars.v1.InferenceService"])
        port = rpc.bind(s, "127.0.0.1", 0)
        await s.start()
        await rpc.set_serving(hs, hp, ["tars.v1.InferenceService"])
        try:
            return await addr_fn(f"127.0.0.1:{port}")
        finally:
            await s.stop(0)
    out = asyncio.run(with_health(go))
    serving, unknown = 1, 3  # HealthCheckResponse.SERVING, SERVICE_UNKNOWN
    assert out[""] == (serving, U)
    assert out["svc-token"] == (serving, unknown)


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + an empty SETTINGS frame


def test_a_connection_that_never_calls_is_closed(monkeypatch):
    """Slowloris: connections that send nothing (or only the HTTP/2 preface) and never call were held for ever, a
    file descriptor each (3,000 of them: 3,000 descriptors, still open minutes later). The server now closes them."""
    monkeypatch.setattr(rpc, "CONN_IDLE_S", 0.5, raising=False)
    monkeypatch.setattr(rpc, "HANDSHAKE_S", 0.5, raising=False)

    async def closed_by_server(addr, hello: bytes) -> bool:
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(hello)
        await writer.drain()
        try:
            async def eof():
                while await reader.read(65536):
                    pass  # the server's SETTINGS, GOAWAY, ...
            await asyncio.wait_for(eof(), 20)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            writer.close()

    async def idle_client_calls_again(addr) -> bool:
        """A client's channel whose connection the server closed while idle reconnects on its next call."""
        async with rpc.channel(addr, "svc-token") as ch:
            stub = ig.InferenceServiceStub(ch)
            await stub.Generate(ipb.GenerateRequest(), timeout=10)
            for _ in range(3):
                await asyncio.sleep(1.0)  # idle past CONN_IDLE_S: the server closes the connection
                if (await stub.Generate(ipb.GenerateRequest(), timeout=10)).output_ids != [7]:
                    return False
        return True

    async def go(addr):
        return await asyncio.gather(closed_by_server(addr, b""), closed_by_server(addr, PREFACE),
                                    idle_client_calls_again(addr))
    assert asyncio.run(_with_server(go)) == [True, True, True]


def test_secrets_that_cannot_work_are_config_errors():
    """A token gRPC cannot send and CURVE keys libzmq refuses (or that are not a pair) stop the config load with one
    line naming the setting, instead of failing every client call (ExecuteBatchError) or the stream (ZMQError)."""
    import pytest
    import zmq

    from core import config as C

    public, secret = (k.decode() for k in zmq.curve_keypair())
    other_public = zmq.curve_keypair()[0].decode()
    ctl = "control.auth_token=ctl-token"
    bad = {("envd.auth_token=tökén", ctl): "envd.auth_token: a token must be visible ASCII",
           ("inference.auth_token=a\x01b", ctl): "inference.auth_token: a token must be visible ASCII",
           ("control.auth_token=naïve",): "control.auth_token: a token must be visible ASCII",
           ("learner.stream.curve_secret_key=notakey",): "learner.stream.curve_secret_key: not a CURVE key",
           ("learner.stream.curve_public_key=" + public[:-1] + " ",): "learner.stream.curve_public_key: not a CURVE key",
           ("learner.stream.curve_secret_key=" + secret, "learner.stream.curve_public_key=" + other_public):
               "learner.stream.curve_public_key is not the public key of learner.stream.curve_secret_key"}
    for sets, why in bad.items():
        with pytest.raises(C.ConfigError, match="^" + why.replace(".", r"\.")):
            C.load("quickstart", None, list(sets))
    cfg = C.load("quickstart", None, ["envd.auth_token=" + "A-z_0~9!" * 4, ctl, "learner.stream.curve_secret_key=" + secret,
                                      "learner.stream.curve_public_key=" + public])
    assert cfg.learner.stream.curve_public_key == public
