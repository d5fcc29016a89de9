"""GenerateBatch and the client's coalescing: calls ready in one loop turn travel as one call per replica, each with
the result, status code and deadline its own Generate would have had; results come back as they finish, those that
finish together in one message; a server without GenerateBatch is called one Generate at a time; a batch whose
callers all gave up stops the server's work."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from grpc import aio

from core import rpc
from core.inference_client import InferenceClient
from core.v1 import inference_pb2, inference_pb2_grpc
from inference_server.server import InferenceServicer
from core.proc import wait_for
from envd_compliance import until
from test_inference_engine import rand_prompt
from test_inference_server import Servers, run


def _req(ids, n=8, temperature=0.0, **kw):
    return inference_pb2.GenerateRequest(trajectory_id=kw.pop("tid", ""), input_ids=ids,
                                         sampling=inference_pb2.SamplingParams(max_new_tokens=n, temperature=temperature, **kw))


def test_coalesced_calls_equal_one_generate_each():
    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start()
            rng = random.Random(3)
            prompts = [rand_prompt(rng, rng.randrange(3, 30)) for _ in range(16)]
            lone = InferenceClient([addr], coalesce=False)
            want = [await lone.generate(f"a{i}", p, 12, temperature=0.0) for i, p in enumerate(prompts)]
            c = InferenceClient([addr])
            got = await asyncio.gather(*(c.generate(f"b{i}", p, 12, temperature=0.0) for i, p in enumerate(prompts)))
            assert (c.batches, c.batched_calls) == (1, 16)  # one call for the 16 made in one loop turn
            for g, w in zip(got, want):
                assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason == "length"
                assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4) and g.versions == w.versions
                assert g.prompt_tokens == w.prompt_tokens and g.replica == addr
            # a lone call is a batch of one and waits for nothing
            r = await c.generate("b0", prompts[0] + got[0].output_ids, 4, temperature=0.0)
            assert c.batches == 2 and r.cached_tokens == len(prompts[0]) + 12 - 1  # the prefix cache still hit
            assert eng.metrics()["requests"] == 33
            await lone.close()
            await c.close()

    run(main())


def test_each_request_keeps_its_own_status_and_deadline():
    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start()
            ch = rpc.channel(addr)
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            reqs = [_req([1, 2, 3]), _req([]), _req([5000]), _req([4, 5], n=0), _req([3, 4], n=250, temperature=1.0),
                    _req([6, 7], n=5), _req([1], temperature=-1)]
            timeouts = [0, 0, 0, 0, 0.05, 0, 0]
            items = {}
            async for msg in stub.GenerateBatch(inference_pb2.GenerateBatchRequest(requests=reqs, timeout_s=timeouts), timeout=20):
                for it in msg.items:
                    assert it.index not in items  # every request is answered exactly once
                    items[it.index] = it
            assert sorted(items) == list(range(len(reqs)))
            codes = {i: grpc.StatusCode.OK if it.code == 0 else next(c for c in grpc.StatusCode if c.value[0] == it.code)
                     for i, it in items.items()}
            assert codes == {0: grpc.StatusCode.OK, 1: grpc.StatusCode.INVALID_ARGUMENT, 2: grpc.StatusCode.INVALID_ARGUMENT,
                             3: grpc.StatusCode.INVALID_ARGUMENT, 4: grpc.StatusCode.DEADLINE_EXCEEDED,
                             5: grpc.StatusCode.OK, 6: grpc.StatusCode.INVALID_ARGUMENT}
            assert len(items[0].response.output_ids) == 8 and len(items[5].response.output_ids) == 5
            # the same request through Generate fails with the same code and details
            with pytest.raises(aio.AioRpcError) as ei:
                await stub.Generate(reqs[2], timeout=5)
            assert (ei.value.code(), ei.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, items[2].error)
            # and the coalescing client raises it as Generate would, the other calls of its batch unharmed
            c = InferenceClient([addr], retries=0)
            ok, bad = await asyncio.gather(c.generate("x", [1, 2, 3], 4), c.generate("y", [5000], 4), return_exceptions=True)
            assert c.batches == 1 and len(ok.output_ids) == 4
            assert isinstance(bad, aio.AioRpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert bad.details() == items[2].error
            with pytest.raises(aio.AioRpcError) as ei:  # a short timeout_s is this call's deadline, not the batch's
                await asyncio.gather(c.generate("z", [3, 4], 250, timeout_s=0.05), c.generate("w", [3, 4], 4, timeout_s=20))
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            too_many = inference_pb2.GenerateBatchRequest(requests=[_req([1])] * 4097)
            with pytest.raises(aio.AioRpcError) as ei:
                async for _ in stub.GenerateBatch(too_many, timeout=5):
                    pass
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_queue" in ei.value.details()
            await c.close()
            await ch.close()
            for _ in range(1000):  # the expired requests were cancelled in the engine (10 s at most)
                if eng.metrics()["running"] == 0 and eng.metrics()["waiting"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert eng.metrics()["running"] == 0 and eng.metrics()["requests_cancelled"] >= 2

    run(main())


def test_results_that_finish_together_share_a_message():
    async def main():
        async with Servers() as s:
            # The engine starts once the whole batch waits in its queue: started at once, it took the first requests
            # before the others were submitted, their prefills fell on different steps, and on a loaded host each
            # result could finish on its own step (33 messages).
            _, eng, addr = await s.start(start_engine=False)
            ch = rpc.channel(addr)
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            reqs = [_req([1 + i % 7, 2, 3], n=16) for i in range(32)] + [_req([9, 9], n=240)]

            async def read():
                return [m async for m in stub.GenerateBatch(inference_pb2.GenerateBatchRequest(requests=reqs), timeout=30)]

            reading = asyncio.create_task(read())
            await until(lambda: eng.metrics()["waiting"] == 33, "the batch queued")
            eng.start()
            # Hold this loop (the server's too) until the 32 short ones have finished: on a loaded host the engine
            # thread was preempted between results and the loop sent each in its own message (33). Posted while the
            # loop is held, they are drained together, as results that finish together are meant to be; the long one
            # still has 224 tokens to go.
            wait_for(lambda: eng.metrics()["requests_finished"] >= 32, 30, "the 32 short requests finished", every=0.001)
            msgs = await reading
            seen = [it.index for m in msgs for it in m.items]
            assert sorted(seen) == list(range(33))
            assert len(msgs) < 16  # the 32 short ones finish on a few decode steps, not one message each
            assert seen[-1] == 32 and len(msgs[-1].items) == 1  # the long one comes last, alone, when it is done
            await ch.close()

    run(main())


async def _unimplemented(self, request, context):
    """GenerateBatch on a server from before it."""
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
    yield  # an async generator, as a streaming handler is


def test_a_server_without_generate_batch_gets_one_generate_per_call(monkeypatch):
    monkeypatch.setattr(InferenceServicer, "GenerateBatch", _unimplemented)

    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start()
            c = InferenceClient([addr])
            rs = await asyncio.gather(*(c.generate(f"t{i}", [1, 2, i + 3], 5, temperature=0.0) for i in range(6)))
            assert all(len(r.output_ids) == 5 for r in rs)
            assert c.batches == 1 and not c._replicas[0].batch  # tried once, then plain calls
            assert len((await c.generate("t0", [1, 2, 3], 5)).output_ids) == 5 and c.batches == 1
            assert eng.metrics()["requests"] == 7
            await c.close()

    run(main())


def test_callers_that_all_give_up_stop_the_server_work():
    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start(max_context=1024)
            c = InferenceClient([addr], timeout_s=60)
            calls = [asyncio.create_task(c.generate(f"t{i}", [1, 2, 3], 900, temperature=1.0)) for i in range(4)]
            while eng.metrics()["tokens_generated"] < 40:
                await asyncio.sleep(0.005)
            for t in calls:
                t.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            for _ in range(500):
                if eng.metrics()["running"] == 0:
                    break
                await asyncio.sleep(0.01)
            m = eng.metrics()
            assert m["running"] == 0 and m["requests_cancelled"] == 4 and m["tokens_generated"] < 4 * 900
            await c.close()

    run(main())


async def _silent(self, request, context):
    """GenerateBatch on a server whose answers never come (its loop stuck, say)."""
    await asyncio.sleep(3600)
    yield


def test_a_coalesced_call_keeps_its_own_deadline_when_the_server_says_nothing(monkeypatch):
    monkeypatch.setattr(InferenceServicer, "GenerateBatch", _silent)

    async def main():
        async with Servers() as s:
            _, _, addr = await s.start()
            c = InferenceClient([addr], retries=0)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            short = asyncio.create_task(c.generate("a", [1, 2], 4, timeout_s=0.3))
            long = asyncio.create_task(c.generate("b", [1, 2], 4, timeout_s=8))
            with pytest.raises(aio.AioRpcError) as ei:
                await short
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and loop.time() - t0 < 4
            assert c.batches == 1 and not long.done()  # the other call of the batch waits on
            long.cancel()
            await c.close()

    run(main())
