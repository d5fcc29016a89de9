"""What the SGLang path answers gRPC callers when SGLang refuses a request, fails it, or answers what tars cannot use."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from core.config import InferenceConfig
from core.inference_client import InferenceClient
from inference_server.server import InferenceServer, make_engine
from test_sglang import PROMPT, greedy, models, servers  # noqa: F401 - fixtures


def front(cfg: InferenceConfig, model: str, body):
    """Run `body(client, engine)` against a gRPC front over the sglang engine of cfg."""
    async def main():
        eng = make_engine(cfg, model)
        srv = InferenceServer(cfg, eng, model_name="sglang")
        await srv.start()
        client = InferenceClient([srv.address], retries=0)
        try:
            return await body(client, eng)
        finally:
            await client.close()
            await srv.stop()
            eng.close()

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_a_request_sglang_refuses_is_invalid_argument_with_its_message(servers, models):
    """SGLang answers 400 for a request it refuses (here: past its own context, smaller than the front's); the front
    answered INTERNAL ("RuntimeError: SGLang /generate ... HTTP 400"), which callers treat as a server fault. The
    replica is not taken out: the next request that fits is served there."""
    s = servers(weight_version="0")  # context 256
    cfg = InferenceConfig(max_context=1024, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=30)

    async def body(client, eng):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await client.generate("t", PROMPT, 300, temperature=0.0)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        assert ei.value.details().startswith("SGLang refused the request: ") and "256" in ei.value.details()
        assert eng.metrics()["replicas_healthy"] == 1
        r = await client.generate("t", PROMPT, 4, temperature=0.0)
        assert r.output_ids == greedy(models["a"], PROMPT, 4)[0]

    front(cfg, models["a"], body)


def test_a_generation_sglang_fails_keeps_its_code(servers, models):
    """A 5xx is the replica's fault, not the request's: the replica is taken out (UNAVAILABLE once none is left),
    never INVALID_ARGUMENT."""
    s = servers(weight_version="0")
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=30,
                          sglang_max_resumes=0)

    def broken(key):
        raise RuntimeError("device lost")

    s.engine._sched.cache.get = broken

    async def body(client, eng):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await client.generate("t", PROMPT, 4, temperature=0.0)
        assert ei.value.code() != grpc.StatusCode.INVALID_ARGUMENT, ei.value
        assert eng.metrics()["replicas_healthy"] == 0

    front(cfg, models["a"], body)
