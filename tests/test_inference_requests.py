"""InferenceService per-request choices and refusals over a real server: the staleness budget, unknown versions,
bytes that are not a request, and weights an engine cannot take."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from grpc import aio

from core.inference_client import InferenceClient
from core import rpc
from core.v1 import inference_pb2, inference_pb2_grpc
from test_inference_engine import make_model, rand_prompt
from test_inference_server import Servers, run


def test_staleness_budget_is_chosen_per_request_and_defaults_to_the_server(tmp_path):
    async def main():
        async with Servers() as s:
            # The server's default keeps KV one version old; a request may still ask for recompute (0).
            _, eng, addr = await s.start(make_model(0), max_stale_versions=1, max_batch=8)
            make_model(1).save_hf(tmp_path / "v1")
            c = InferenceClient([addr])
            rng = random.Random(4)
            kinds = {"default": None, "recompute": 0, "keep": 1}
            tasks = {k: asyncio.create_task(c.generate(k, rand_prompt(rng, 20), 200, max_stale_versions=v)) for k, v in kinds.items()}
            while eng.metrics()["running"] < 3 or eng.metrics()["tokens_generated"] < 30:
                await asyncio.sleep(0.002)
            await c.update_weights(1, path=str(tmp_path / "v1"))
            rs = {k: await t for k, t in tasks.items()}
            assert all(r.interruptions == 1 and set(r.versions) == {0, 1} for r in rs.values())
            m = eng.metrics()
            assert m["stale_kv_kept"] == 2                      # "default" and "keep"
            assert m["recomputed_tokens"] == 20 + rs["recompute"].versions.index(1)  # only "recompute": its prompt + tokens so far
            with pytest.raises(aio.AioRpcError) as ei:
                await c.generate("bad", [1, 2], 2, max_stale_versions=-1)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_stale_versions" in ei.value.details()
            await c.close()

    run(main())


def test_unknown_versions_and_undecodable_requests(tmp_path):
    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start(make_model(0), version=3)
            make_model(1).save_hf(tmp_path / "ok")
            ch = rpc.channel(addr)
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            for v in (3, 2, -1):  # not newer than the served version: refused, whatever the weights
                with pytest.raises(aio.AioRpcError) as ei:
                    await stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=v, path=str(tmp_path / "ok")), timeout=10)
                assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in ei.value.details()
            assert (await stub.GetVersion(inference_pb2.GetVersionRequest(), timeout=5)).version == 3
            # Bytes that are not a GenerateRequest: refused by the server's decoder, and it goes on serving.
            raw = ch.unary_unary("/tars.v1.InferenceService/Generate", request_serializer=None, response_deserializer=None)
            with pytest.raises(aio.AioRpcError) as ei:
                await raw(b"\xff\xff\xff\xff", timeout=5)
            assert ei.value.code() != grpc.StatusCode.OK
            # Too long for the context, and a deadline too short to generate: clear statuses.
            for req, code in ((inference_pb2.GenerateRequest(input_ids=[1] * 250, sampling=inference_pb2.SamplingParams(max_new_tokens=10)),
                               grpc.StatusCode.INVALID_ARGUMENT),):
                with pytest.raises(aio.AioRpcError) as ei:
                    await stub.Generate(req, timeout=5)
                assert ei.value.code() == code and "max_context" in ei.value.details()
            ok = await stub.Generate(inference_pb2.GenerateRequest(input_ids=[1, 2], sampling=inference_pb2.SamplingParams(max_new_tokens=2)), timeout=10)
            assert len(ok.output_ids) == 2 and list(ok.versions) == [3, 3]
            await ch.close()

    run(main())


def test_streamed_weights_refused_by_a_disk_only_engine(tmp_path):
    from inference_server.server import InferenceServer
    from inference_server.sglang_engine import SGLangEngine
    from core.weights_stream import chunks
    from core.config import InferenceConfig

    async def main():
        cfg = InferenceConfig(engine="sglang", sglang_urls=["http://127.0.0.1:9"])
        eng = SGLangEngine(cfg, cfg.sglang_urls, health_thread=False)
        srv = InferenceServer(cfg, eng)
        await srv.start()
        ch = rpc.channel(srv.address)
        try:
            with pytest.raises(aio.AioRpcError) as ei:
                await inference_pb2_grpc.InferenceServiceStub(ch).UpdateWeightsStream(chunks(1, make_model(1).hf_state_dict()), timeout=10)
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "path" in ei.value.details()
        finally:
            await ch.close()
            await srv.stop(grace=0.5)
            eng.close()

    run(main())


def test_long_refusals_keep_their_code(monkeypatch):
    """An engine error can echo what a client or an SGLang server wrote (a rejection's message, a path); the front
    clips every status message, so a 40 KB one still arrives as its own code, not RESOURCE_EXHAUSTED from the peer's
    metadata limit, and a GenerateBatch item carries the same clipped text."""
    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start(make_model(0))
            ok = eng.validate

            def validate(ids, p):
                if ids[0] == 7:
                    raise ValueError("SGLang rejected the request: " + "é" * 20000)
                return ok(ids, p)
            monkeypatch.setattr(eng, "validate", validate)
            stub = inference_pb2_grpc.InferenceServiceStub(rpc.channel(addr))
            req = inference_pb2.GenerateRequest(input_ids=[7, 1], sampling=inference_pb2.SamplingParams(max_new_tokens=2))
            for call in (stub.Generate(req, timeout=10), _drain(stub.GenerateStream(req, timeout=10))):
                with pytest.raises(aio.AioRpcError) as ei:
                    await call
                d = ei.value.details()
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (ei.value.code(), d[:200])
                assert d.startswith("SGLang rejected the request: éé") and len(d.encode()) < rpc.MAX_DETAILS + 40
                assert d.endswith("more bytes]")
            batch = inference_pb2.GenerateBatchRequest(requests=[req, inference_pb2.GenerateRequest(
                input_ids=[1, 2], sampling=inference_pb2.SamplingParams(max_new_tokens=2))])
            items = [it async for msg in stub.GenerateBatch(batch, timeout=10) for it in msg.items]
            bad = next(it for it in items if it.index == 0)
            assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and len(bad.error.encode()) < rpc.MAX_DETAILS + 40
            assert next(it for it in items if it.index == 1).code == 0
    run(main())


async def _drain(stream):
    async for _ in stream:
        pass


def test_oversized_prompts_and_stop_lists_are_refused_by_their_sizes_alone():
    """The front used to list and validate every id of a prompt (on its event loop) before the engine refused one
    past max_context: 20 M ids held every other call for seconds. Sizes are checked first now; the engine never sees
    the request."""
    from core.config import InferenceConfig
    from inference_server.scripted import ScriptedEngine
    from inference_server.server import InferenceServicer

    seen = []
    eng = ScriptedEngine(lambda ids, _images: seen.append(len(ids)) or [1], vocab_size=300)
    front = InferenceServicer(InferenceConfig(max_context=256), eng)

    def req(n, k=0):
        return inference_pb2.GenerateRequest(input_ids=[5] * n, sampling=inference_pb2.SamplingParams(
            max_new_tokens=4, stop_token_ids=[7] * k))

    with pytest.raises(ValueError, match="max_context"):
        front._engine_submit(req(257))
    with pytest.raises(ValueError, match="stop_token_ids"):
        front._engine_submit(req(3, 301))
    assert seen == []
    assert front._engine_submit(req(3, 300)).result(1).output_ids == [1] and seen == [3]


def _short_request(**sampling) -> inference_pb2.GenerateRequest:
    """A 3-token prompt asking for 4 tokens with these sampling parameters."""
    return inference_pb2.GenerateRequest(input_ids=[5, 6, 7], sampling=inference_pb2.SamplingParams(
        max_new_tokens=4, **sampling))


@pytest.mark.parametrize("top_p", [float("nan"), -0.5])
def test_a_nan_or_negative_top_p_is_refused_not_served_untruncated(top_p):
    """The front mapped every top_p <= 0 (and NaN, which compares false) to 1.0, "off", before the engine's own check
    (top_p in [0, 1]) could see it: such a request answered OK, sampled from the whole distribution. Only the proto3
    zero (unset) means off now."""
    from core.config import InferenceConfig
    from inference_server.engine import LocalEngine
    from inference_server.server import InferenceServicer
    from test_inference_engine import make_model

    cfg = InferenceConfig(max_context=64)
    eng = LocalEngine(cfg, make_model(0), start=False)
    try:
        front = InferenceServicer(cfg, eng)
        with pytest.raises(ValueError, match="top_p"):
            front._engine_submit(_short_request(top_p=top_p))
        assert eng.metrics()["requests"] == 0
        front._engine_submit(_short_request(top_p=0.0))  # unset: off, accepted
        assert eng.metrics()["requests"] == 1
    finally:
        eng.close()


@pytest.mark.parametrize("engine", ["local", "sglang"])
@pytest.mark.parametrize("temperature", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_temperature_is_refused_not_served_uniform(engine, temperature):
    """temperature=inf passed both engines' check (temperature >= 0): the logits divided by it are all 0, so the call
    answered OK with uniform samples (every logprob -log V). It is INVALID_ARGUMENT now, as NaN and negatives are."""
    from core.config import InferenceConfig
    from inference_server.engine import LocalEngine
    from inference_server.server import InferenceServicer
    from inference_server.sglang_engine import SGLangEngine

    if engine == "local":
        cfg = InferenceConfig(max_context=64)
        eng = LocalEngine(cfg, make_model(0), start=False)
    else:
        cfg = InferenceConfig(engine="sglang", sglang_urls=["http://127.0.0.1:9"], max_context=64)
        eng = SGLangEngine(cfg, cfg.sglang_urls, health_thread=False)
    try:
        front = InferenceServicer(cfg, eng)
        with pytest.raises(ValueError, match="temperature must be finite"):
            front._engine_submit(_short_request(temperature=temperature))
        assert eng.metrics()["requests"] == 0
        if engine == "local":
            front._engine_submit(_short_request(temperature=3.4e38))  # the largest float32: finite, accepted
            assert eng.metrics()["requests"] == 1
    finally:
        eng.close()
