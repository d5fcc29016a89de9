"""The gRPC front on real servers (port 0, in process): round trips, streams, live weight updates, statuses, routing."""
from __future__ import annotations

import asyncio
import json
import random
import time

import grpc
import pytest
from grpc import aio

from core.inference_client import InferenceClient
from inference_server.engine import LocalEngine
from inference_server.server import InferenceServer
from core import rpc
from core.config import InferenceConfig
from core.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from test_inference_engine import make_model, rand_prompt, ref_greedy


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Servers:
    """Starts servers with their own engines and tears everything down, in the test's event loop."""

    def __init__(self):
        self.items: list[tuple[InferenceServer, LocalEngine]] = []

    async def start(self, model=None, start_engine=True, version=0, **kw) -> tuple[InferenceServer, LocalEngine, str]:
        cfg = InferenceConfig(**{"max_context": 256, **kw})
        eng = LocalEngine(cfg, model or make_model(0), version=version, start=start_engine)
        srv = InferenceServer(cfg, eng, model_name="tiny")
        await srv.start()
        self.items.append((srv, eng))
        return srv, eng, srv.address

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        for srv, eng in self.items:
            await srv.stop(grace=0.5)
            await asyncio.to_thread(eng.close)


def test_generate_and_stream_round_trip():
    async def main():
        async with Servers() as s:
            m = make_model(0)
            _, eng, addr = await s.start(make_model(0))
            c = InferenceClient([addr])
            p = rand_prompt(random.Random(0), 15)
            r = await c.generate("t1", p, max_new_tokens=12, temperature=0.0)
            want, lps = ref_greedy(m, p, 12)
            assert r.output_ids == want and r.versions == [0] * 12 and r.finish_reason == "length"
            assert max(abs(a - b) for a, b in zip(r.logprobs, lps)) < 1e-4
            assert r.prompt_tokens == 15 and r.replica == addr
            chunks = [ch async for ch in c.generate_stream("t2", p, max_new_tokens=12, temperature=0.0)]
            assert sum((ch.output_ids for ch in chunks), []) == want
            assert chunks[-1].finish_reason == "length" and all(not ch.finish_reason for ch in chunks[:-1])
            stop = want[2]
            r = await c.generate("t3", p, max_new_tokens=12, temperature=0.0, stop_token_ids=[stop])
            assert r.output_ids == want[: want.index(stop) + 1] and r.finish_reason == "stop"
            assert await c.get_version() == 0
            await c.close()

    run(main())


def test_update_weights_while_16_generations_in_flight(tmp_path):
    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start(make_model(0))
            make_model(1).save_hf(tmp_path / "v1")
            c = InferenceClient([addr])
            rng = random.Random(1)
            n_new = 120
            tasks = [asyncio.create_task(c.generate(f"t{i}", rand_prompt(rng, rng.randrange(3, 40)), n_new, temperature=1.0,
                                                    max_stale_versions=i % 2)) for i in range(16)]
            while eng.metrics()["tokens_generated"] < 16 * 10:
                await asyncio.sleep(0.002)
            up = await c.update_weights(1, path=str(tmp_path / "v1"))
            assert up[0]["version"] == 1 and up[0]["interrupted_requests"] > 0
            results = await asyncio.gather(*tasks)
            assert all(len(r.output_ids) == n_new and r.finish_reason == "length" for r in results)
            assert all(r.versions == sorted(r.versions) for r in results)
            spans = [r for r in results if set(r.versions) == {0, 1}]
            assert spans and all(r.interruptions == 1 for r in spans)
            # Inline weights (no shared disk) work too.
            data = (tmp_path / "v1" / "model.safetensors").read_bytes()
            assert (await c.update_weights(2, data=data))[0]["version"] == 2
            assert await c.get_version() == 2
            m = eng.metrics()
            assert m["weight_updates"] == 2 and m["recomputed_tokens"] > 0 and m["stale_kv_kept"] > 0
            await c.close()

    run(main())


def test_status_codes():
    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start(make_model(0))
            ch = rpc.channel(addr)
            stub = inference_pb2_grpc.InferenceServiceStub(ch)

            async def code(coro):
                with pytest.raises(aio.AioRpcError) as ei:
                    await coro
                return ei.value.code()

            def req(ids, **sp):
                return inference_pb2.GenerateRequest(input_ids=ids, sampling=inference_pb2.SamplingParams(**{"max_new_tokens": 4, **sp}))

            INVALID = grpc.StatusCode.INVALID_ARGUMENT
            assert await code(stub.Generate(req([]), timeout=5)) == INVALID
            assert await code(stub.Generate(req([1], max_new_tokens=0), timeout=5)) == INVALID
            assert await code(stub.Generate(req([1] * 300), timeout=5)) == INVALID
            assert await code(stub.Generate(req([1], temperature=-1), timeout=5)) == INVALID
            assert await code(stub.Generate(req([5000]), timeout=5)) == INVALID
            chunks = stub.GenerateStream(req([]), timeout=5)
            assert await code(chunks.read()) == INVALID
            FAILED = grpc.StatusCode.FAILED_PRECONDITION
            assert await code(stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=0, path="/nope"), timeout=5)) == FAILED
            assert await code(stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=1, path="/nope"), timeout=5)) == FAILED
            assert await code(stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=1, safetensors=b"junk"), timeout=5)) == FAILED
            # A passed deadline cancels the engine request so it stops consuming compute.
            assert await code(stub.Generate(req([3, 4], max_new_tokens=250), timeout=0.05)) == grpc.StatusCode.DEADLINE_EXCEEDED
            t0 = time.monotonic()
            while not eng.metrics()["requests_cancelled"] and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.01)
            assert eng.metrics()["requests_cancelled"] == 1 and eng.metrics()["tokens_generated"] < 250
            await ch.close()

            # Queue full: an engine that is not running keeps its one queue slot taken.
            _, idle, addr2 = await s.start(make_model(0), start_engine=False, max_queue=1)
            c = InferenceClient([addr2], retries=1, backoff_s=0.01)
            first = asyncio.create_task(c.generate("a", [1, 2], 4, timeout_s=30))
            while not idle.metrics()["waiting"]:
                await asyncio.sleep(0.005)
            with pytest.raises(aio.AioRpcError) as ei:
                await c.generate("b", [1, 2], 4)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert idle.metrics()["requests_rejected_queue_full"] == 2  # one try + one retry
            idle.start()
            assert len((await first).output_ids) == 4
            await c.close()

    run(main())


def test_a_failure_after_submit_is_the_same_code_on_every_path(monkeypatch):
    """An engine request that fails after it was accepted (here a ValueError from the engine) is INTERNAL with the
    error in the details for Generate, GenerateStream and a GenerateBatch item alike; a closed engine is UNAVAILABLE."""
    import concurrent.futures

    from inference_server.engine import EngineClosed

    async def main():
        async with Servers() as s:
            srv, _, addr = await s.start(make_model(0))
            errors = [ValueError("bad row 3")]

            def failing_submit(request, on_token=None):
                f = concurrent.futures.Future()
                f.set_exception(errors[0])
                return f

            monkeypatch.setattr(srv.servicer, "_engine_submit", failing_submit)
            ch = rpc.channel(addr)
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            req = inference_pb2.GenerateRequest(input_ids=[1, 2], sampling=inference_pb2.SamplingParams(max_new_tokens=4))
            for err, code in ((ValueError("bad row 3"), grpc.StatusCode.INTERNAL),
                              (EngineClosed("engine closed"), grpc.StatusCode.UNAVAILABLE)):
                errors[0] = err
                with pytest.raises(aio.AioRpcError) as unary:
                    await stub.Generate(req, timeout=5)
                with pytest.raises(aio.AioRpcError) as streamed:
                    await stub.GenerateStream(req, timeout=5).read()
                batch = [m async for m in stub.GenerateBatch(inference_pb2.GenerateBatchRequest(requests=[req]), timeout=5)]
                item = batch[0].items[0]
                assert unary.value.code() == streamed.value.code() == code and item.code == code.value[0]
                assert unary.value.details() == streamed.value.details() == item.error and str(err) in item.error
            await ch.close()

    run(main())


def test_auth_control_and_health():
    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start(make_model(0), auth_token="s3cret")
            bad = InferenceClient([addr], retries=0)
            with pytest.raises(aio.AioRpcError) as ei:
                await bad.generate("t", [1, 2, 3], 4)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await bad.close()
            good = InferenceClient([addr], auth_token="s3cret")
            assert len((await good.generate("t", [1, 2, 3], 4)).output_ids) == 4
            assert good.batches == 1  # coalesced: a GenerateBatch call (server streaming) carried the token too
            # every call kind carries the token (grpc.aio files an interceptor under one kind only)
            assert sum(len(c.output_ids) for c in [c async for c in good.generate_stream("t", [1, 2, 3], 4)]) == 4
            assert (await good.update_weights_streamed(1, make_model(1).hf_state_dict()))[0]["version"] == 1
            plain = InferenceClient([addr], auth_token="s3cret", coalesce=False)
            assert len((await plain.generate("t", [1, 2, 3], 4)).output_ids) == 4 and plain.batches == 0
            await plain.close()
            await good.close()
            ch = rpc.channel(addr, "s3cret")
            st = await control_pb2_grpc.ControlServiceStub(ch).Status(control_pb2.StatusRequest(), timeout=5)
            metrics = json.loads(st.metrics_json)
            assert st.role == "inference" and metrics["tokens_generated"] == 12 and metrics["requests"] == 3
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="tars.v1.InferenceService"), timeout=5)
            assert h.status == health_pb2.HealthCheckResponse.SERVING
            await ch.close()

    run(main())


def test_client_sticky_routing_across_two_servers():
    async def main():
        async with Servers() as s:
            _, _, a1 = await s.start(make_model(0))
            _, _, a2 = await s.start(make_model(0))
            c = InferenceClient([a1, a2])
            rng = random.Random(2)
            prompts = {f"traj-{i}": rand_prompt(rng, 10) for i in range(8)}
            first = dict(zip(prompts, await asyncio.gather(*(c.generate(t, p, 5, temperature=0.0) for t, p in prompts.items()))))
            second = await asyncio.gather(*(c.generate(t, p + first[t].output_ids + [7], 5, temperature=0.0) for t, p in prompts.items()))
            for t, r2 in zip(prompts, second):
                assert r2.replica == first[t].replica  # sticky, so the prefix cache is hit
                assert r2.cached_tokens == 10 + 5 - 1
            assert {r.replica for r in first.values()} == {a1, a2}  # least-loaded spreads new trajectories
            await c.close()

    run(main())


def test_weights_paths_are_confined_to_weights_root(tmp_path):
    """With inference.weights_root (what `tars up` sets: the run's weights/), a path outside it, through a symlink
    inside it included, is INVALID_ARGUMENT with a message that says nothing of what is there; inside it loads."""
    import os

    root = tmp_path / "weights"
    make_model(1).save_hf(root / "v1")
    make_model(2).save_hf(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", root / "v2")

    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start(make_model(0), weights_root=str(root))
            stub = inference_pb2_grpc.InferenceServiceStub(rpc.channel(addr, ""))
            for path in (str(tmp_path / "elsewhere"), str(root / "v2"), "/etc/shadow", str(root / ".." / "elsewhere")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=1, path=path), timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details() == "the weights path is outside inference.weights_root"
            assert eng.version == 0
            r = await stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=1, path=str(root / "v1")), timeout=30)
            assert r.version == 1 and eng.version == 1

    run(main())
