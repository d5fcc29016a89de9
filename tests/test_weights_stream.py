"""UpdateWeightsStream: weights as a stream of tensor pieces over a real gRPC server, and its refusals."""
from __future__ import annotations

import random

import grpc
import pytest
import torch
from grpc import aio

from core.inference_client import InferenceClient
from core.weights_stream import Assembler, BadChunk, WrongWeights, chunks
from core import rpc
from core.v1 import inference_pb2, inference_pb2_grpc
from test_inference_engine import make_model, rand_prompt, ref_greedy
from test_inference_server import Servers, run


def test_chunks_round_trip_in_small_pieces_and_dtypes():
    sd = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(2, 2).half(),
          "t": torch.randn(5, 3).t(), "e": torch.empty(0, 4), "s": torch.tensor(1.5)}
    msgs = list(chunks(9, sd, piece_bytes=8))
    assert msgs[0].version == 9 and all(m.version == 0 for m in msgs[1:])
    assert len(msgs) > len(sd)  # tensors were split
    asm = Assembler({k: tuple(v.shape) for k, v in sd.items()})
    for m in msgs:
        asm.add(m)
    version, out = asm.finish()
    assert version == 9 and set(out) == set(sd)
    for k in sd:
        assert out[k].dtype == sd[k].dtype and torch.equal(out[k], sd[k])


def test_assembler_refuses_malformed_and_foreign_streams():
    shapes = {"w": (2, 3)}
    good = list(chunks(1, {"w": torch.ones(2, 3)}, piece_bytes=8))

    def feed(msgs, shapes=shapes):
        a = Assembler(shapes)
        for m in msgs:
            a.add(m)
        return a.finish()

    with pytest.raises(BadChunk, match="version"):
        feed([inference_pb2.WeightsChunk(name="w", dtype="float32", shape=[2, 3])])
    with pytest.raises(BadChunk, match="dtype"):
        feed([inference_pb2.WeightsChunk(version=1, name="w", dtype="int8", shape=[2, 3])])
    with pytest.raises(WrongWeights, match="not a weight"):
        feed([inference_pb2.WeightsChunk(version=1, name="x", dtype="float32", shape=[2, 3])])
    with pytest.raises(WrongWeights, match="shape"):
        feed([inference_pb2.WeightsChunk(version=1, name="w", dtype="float32", shape=[3, 2])])
    with pytest.raises(BadChunk, match="expected"):
        feed(good[:-1])                                    # truncated tensor
    with pytest.raises(BadChunk, match="more bytes"):
        feed(good + [inference_pb2.WeightsChunk(data=b"\0" * 4)])
    with pytest.raises(WrongWeights, match="without"):
        feed(good, {"w": (2, 3), "v": (1,)})               # a tensor never sent
    with pytest.raises(BadChunk, match="empty"):
        feed([])
    assert torch.equal(feed(good)[1]["w"], torch.ones(2, 3))


def test_streamed_update_installs_weights_on_a_live_server():
    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start(make_model(0), max_message_bytes=64 << 10)  # smaller than the model
            new = make_model(1)
            c = InferenceClient([addr])
            p = rand_prompt(random.Random(3), 12)
            busy = await c.generate("t", p, 4, temperature=0.0)
            assert busy.output_ids == ref_greedy(make_model(0), p, 4)[0]
            up = await c.update_weights_streamed(1, new.hf_state_dict(), piece_bytes=16 << 10)
            assert up[0]["version"] == 1 and eng.version == 1
            r = await c.generate("u", p, 6, temperature=0.0)
            assert r.output_ids == ref_greedy(new, p, 6)[0] and r.versions == [1] * 6

            stub = inference_pb2_grpc.InferenceServiceStub(rpc.channel(addr))

            async def code(msgs):
                with pytest.raises(aio.AioRpcError) as ei:
                    await stub.UpdateWeightsStream(iter(msgs), timeout=10)
                return ei.value.code(), ei.value.details()

            sd = new.hf_state_dict()
            assert (await code(chunks(1, sd, 16 << 10)))[0] == grpc.StatusCode.FAILED_PRECONDITION          # not newer
            bad = dict(sd)
            bad["model.norm.weight"] = torch.ones(3)
            st, msg = await code(chunks(2, bad, 16 << 10))
            assert st == grpc.StatusCode.FAILED_PRECONDITION and "model.norm.weight" in msg
            st, msg = await code([inference_pb2.WeightsChunk(version=2, data=b"x")])
            assert st == grpc.StatusCode.INVALID_ARGUMENT and "must name it" in msg
            assert eng.version == 1 and (await c.get_version()) == 1    # nothing half-installed
            await c.close()

    run(main())
