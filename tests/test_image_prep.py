"""A request's images are prepared off the inference server's event loop (inference_server/image_prep.py).

A tiny VL checkpoint on the local engine behind the real gRPC front. The image processor is held at a gate (an
event, not a timer) while a request with images is being prepared: a health check and a text generation are
answered meanwhile, on both Generate and GenerateBatch. An unreadable image is still INVALID_ARGUMENT; past
inference.image_queue a request with images is RESOURCE_EXHAUSTED; a request whose deadline passes while it waits
for a preparing thread is DEADLINE_EXCEEDED and never prepared.
"""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core import rpc, vlm
from envd_compliance import until
from core.chat import ChatTokenizer
from core.config import InferenceConfig
from core.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from core.vlm import VLSpec, png_size
from inference_server.engine import LocalEngine
from inference_server.server import InferenceServer
from tars.bench.episodes import screenshot
from tests.hf_dirs import make_vl_checkpoint

HOLD_S = 60.0  # the most a gate holds a preparation (the test fails if it ever has to give up)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    d = tmp_path_factory.mktemp("vl") / "ckpt"
    make_vl_checkpoint(d, max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28)
    return d, VLSpec.load(d), ChatTokenizer.load(d)


class Gate:
    """Wraps the checkpoint's image processor: each call says it entered, then waits for release (at most HOLD_S)."""

    def __init__(self, proc):
        self.proc, self.calls, self.gave_up = proc, 0, False
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, *a, **k):
        self.calls += 1
        self.entered.set()
        if not self.release.wait(HOLD_S):
            self.gave_up = True
        return self.proc(*a, **k)


@pytest.fixture
def gate(vl):
    d, spec, _ = vl
    proc = spec.processor()
    g = vlm._PROCESSORS[spec.path] = Gate(proc)
    yield g
    g.release.set()
    vlm._PROCESSORS[spec.path] = proc


def _image_request(spec, tok, png) -> inference_pb2.GenerateRequest:
    ids = tok.first_prompt("you are an agent", ["screen", spec.image_tokens(*png_size(png)), "click"])
    return inference_pb2.GenerateRequest(input_ids=ids, images=[common_pb2.Image(data=png)],
                                         sampling=inference_pb2.SamplingParams(max_new_tokens=2))


async def _call(stub, batch: bool, req, timeout: float):
    """(status code, response) of one request sent as Generate or as a GenerateBatch of one."""
    if not batch:
        try:
            return grpc.StatusCode.OK, await stub.Generate(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
    items = [it async for m in stub.GenerateBatch(inference_pb2.GenerateBatchRequest(requests=[req], timeout_s=[timeout]),
                                                  timeout=timeout + 30) for it in m.items]
    assert len(items) == 1
    code = next(c for c in grpc.StatusCode if c.value[0] == items[0].code)
    return code, items[0].response if code == grpc.StatusCode.OK else items[0].error


async def _serve(d, **cfg):
    e = LocalEngine(InferenceConfig(max_context=1024, cache_capacity=0), str(d))
    srv = InferenceServer(InferenceConfig(host="127.0.0.1", port=0, max_context=1024, **cfg), e)
    await srv.start()
    ch = rpc.channel(srv.address)
    return e, srv, ch, inference_pb2_grpc.InferenceServiceStub(ch)


async def _close(e, srv, ch):
    await ch.close()
    await srv.stop(0)
    e.close()


@pytest.mark.parametrize("batch", [False, True], ids=["Generate", "GenerateBatch"])
def test_calls_are_answered_while_a_request_s_images_are_prepared(vl, gate, batch):
    d, spec, tok = vl
    text = tok.first_prompt("you are an agent", ["no screen today"])

    async def main():
        e, srv, ch, stub = await _serve(d)
        try:
            big = asyncio.ensure_future(_call(stub, batch, _image_request(spec, tok, screenshot(640, 480, 1)), 120))
            assert await asyncio.to_thread(gate.entered.wait, HOLD_S)
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=HOLD_S / 2)
            small = await _call(stub, batch, inference_pb2.GenerateRequest(
                input_ids=text, sampling=inference_pb2.SamplingParams(max_new_tokens=2)), HOLD_S / 2)
            held = not gate.release.is_set() and not gate.gave_up and not big.done()
            gate.release.set()
            code, r = await asyncio.wait_for(big, 120)
            return health, small, held, code, r
        finally:
            await _close(e, srv, ch)

    health, (small_code, small), held, code, r = asyncio.run(main())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert small_code == grpc.StatusCode.OK and len(small.output_ids) == 2
    assert held and not gate.gave_up  # both were answered while the preparation was held
    assert code == grpc.StatusCode.OK and len(r.output_ids) == 2 and gate.calls == 1


@pytest.mark.parametrize("batch", [False, True], ids=["Generate", "GenerateBatch"])
def test_unreadable_images_the_bound_and_the_deadline(vl, gate, batch):
    d, spec, tok = vl
    png = screenshot(640, 480, 2)
    good = _image_request(spec, tok, png)

    async def main():
        e, srv, ch, stub = await _serve(d, image_threads=1, image_queue=2)
        try:
            bad = _image_request(spec, tok, png)
            bad.images[0].data = png[: len(png) // 2]  # cut short: the header reads, the pixels do not
            gate.release.set()
            unreadable = await _call(stub, batch, bad, 60)
            gate.release.clear()
            calls = gate.calls
            first = asyncio.ensure_future(_call(stub, batch, good, 120))  # held at the gate, on the one thread
            assert await asyncio.to_thread(gate.entered.wait, HOLD_S)
            late = await _call(stub, batch, good, 1.0)  # waits for the thread past its deadline (2 admitted)
            await until(lambda: srv.servicer.prep.admitted == 1, "the late request dropped", HOLD_S)
            waiting = asyncio.ensure_future(_call(stub, batch, good, 120))  # admitted: 2 with `first`
            await until(lambda: srv.servicer.prep.admitted == 2, "the second request admitted", HOLD_S)
            full = await _call(stub, batch, good, 60)  # a third: over image_queue=2
            gate.release.set()
            outs = await asyncio.wait_for(asyncio.gather(first, waiting), 120)
            return unreadable, late, full, outs, gate.calls - calls
        finally:
            await _close(e, srv, ch)

    unreadable, late, full, outs, prepared = asyncio.run(main())
    assert unreadable[0] == grpc.StatusCode.INVALID_ARGUMENT and "readable" in unreadable[1]
    assert late[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert full[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "inference.image_queue=2" in full[1]
    assert [c for c, _ in outs] == [grpc.StatusCode.OK] * 2
    assert prepared == 2 and not gate.gave_up  # `first` and `waiting`: the late one was never prepared

