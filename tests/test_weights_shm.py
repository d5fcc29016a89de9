"""Weights through shared memory (core/weights_shm.py, learner.publish.mode=shm) to a real `tars serve` process:
the served version and outputs change, nothing is left in /dev/shm, a killed publisher's segment is removed by the
next learner, and names or segments a client should not be able to make the server read are refused."""
from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import subprocess
import sys

import grpc
import pytest
import torch

from core import rpc, weights_shm
from core.config_learner import PublishConfig
from core.model_config import DecoderConfig
from core.v1 import inference_pb2, inference_pb2_grpc
from learner.policy import TrainPolicy
from tests.served import served as tars_serve

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKEN = "shm-test-token"
pytestmark = pytest.mark.skipif(not weights_shm.available(), reason="no writable /dev/shm")


def tiny() -> TrainPolicy:
    return TrainPolicy.from_config(DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2), seed=0)


def segments(prefix: str) -> list[str]:
    return [n for n in os.listdir(weights_shm.SHM_DIR) if n.startswith(prefix)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A `tars serve` process over a tiny model: (address, its model directory, the run directory to publish from)."""
    d = tmp_path_factory.mktemp("shm")
    tiny().save_hf(d / "model")
    with tars_serve(d, "--model", str(d / "model"), "--set", "inference.port=0", "--set",
                    f"inference.auth_token={TOKEN}", "--set", f"control.auth_token={TOKEN}", ready_s=120) as addr:
        yield addr, d / "model", d / "run"


def _stub(addr):
    return inference_pb2_grpc.InferenceServiceStub(rpc.sync_channel(addr, TOKEN))


def _greedy_logprobs(stub) -> list[float]:
    req = inference_pb2.GenerateRequest(input_ids=[1, 2, 3, 4, 5], trajectory_id="shm-probe",
                                        sampling=inference_pb2.SamplingParams(max_new_tokens=6, temperature=0.0))
    out = stub.Generate(req, timeout=30)
    return list(out.logprobs)


def test_learner_publishes_through_shm_to_a_served_engine(served):
    from learner.publish import Publisher

    addr, model, run = served
    stub = _stub(addr)
    before_lp = _greedy_logprobs(stub)
    v0 = stub.GetVersion(inference_pb2.GetVersionRequest(), timeout=10).version
    policy = TrainPolicy.load(model)
    with torch.no_grad():
        for p in policy.lm.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    run.mkdir(exist_ok=True)
    counters = collections.Counter()
    pub = Publisher(policy, run, [addr], TOKEN, PublishConfig(mode="auto"), counters)
    assert pub.mode == "shm"                        # auto: a loopback server
    s = pub.publish(v0 + 1)
    assert s > 0 and counters["publish_failures"] == 0
    assert stub.GetVersion(inference_pb2.GetVersionRequest(), timeout=10).version == v0 + 1
    after_lp = _greedy_logprobs(stub)
    assert after_lp != before_lp                    # the served outputs come from the new weights
    assert segments(pub.shm_prefix) == []           # unlinked once the server answered
    assert (run / "weights" / f"v{v0 + 1:06d}" / "config.json").exists()   # the copy a restarted server loads


def test_a_full_shm_falls_back_to_disk_for_that_version(served, monkeypatch):
    from learner.publish import Publisher

    addr, model, run = served
    stub = _stub(addr)
    v = stub.GetVersion(inference_pb2.GetVersionRequest(), timeout=10).version
    run.mkdir(exist_ok=True)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights_shm, "write_segment", full)
    counters = collections.Counter()
    pub = Publisher(TrainPolicy.load(model), run, [addr], TOKEN, PublishConfig(mode="shm"), counters)
    pub.publish(v + 1)
    assert counters["publish_shm_fallbacks"] == 1 and counters["publish_failures"] == 0
    assert stub.GetVersion(inference_pb2.GetVersionRequest(), timeout=10).version == v + 1


def test_a_killed_publisher_leaves_no_segment_after_the_next_start(tmp_path):
    """A learner SIGKILLed between writing a segment and unlinking it: the next learner of the run removes it."""
    from learner.publish import Publisher

    run = tmp_path / "run"
    run.mkdir()
    code = ("import os, signal, sys, torch; from core import weights_shm as w; "
            f"n = w.write_segment(w.run_prefix({str(run)!r}), 3, {{'x': torch.ones(1000)}}); "
            "print(n, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    prefix = weights_shm.run_prefix(run)
    assert segments(prefix) == [r.stdout.split()[0]]
    other = weights_shm.write_segment(weights_shm.run_prefix(tmp_path / "another-run"), 1, {"x": torch.ones(3)})
    try:
        Publisher(tiny(), run, [], "", PublishConfig(mode="shm"), collections.Counter())
        assert segments(prefix) == []
        assert os.path.exists(os.path.join(weights_shm.SHM_DIR, other))   # another run's segment is not ours
    finally:
        weights_shm.unlink(other)


def test_hostile_names_and_segments_are_refused_and_change_nothing(served, tmp_path):
    addr, _, _ = served
    stub = _stub(addr)
    v = stub.GetVersion(inference_pb2.GetVersionRequest(), timeout=10).version
    secret = tmp_path / "secret.safetensors"
    TrainPolicy.load(served[1]).save_hf(tmp_path / "ok")       # real weights the server could load if it followed
    secret.write_bytes((tmp_path / "ok" / "model.safetensors").read_bytes())
    link = f"tars-w-{'0' * 12}-v{v + 1}-1"
    junk = f"tars-w-{'1' * 12}-v{v + 1}-1"
    lying = f"tars-w-{'2' * 12}-v{v + 1}-1"
    os.symlink(secret, os.path.join(weights_shm.SHM_DIR, link))
    pathlib.Path(weights_shm.SHM_DIR, junk).write_bytes(b"not a segment at all" * 10)
    # a well-formed header whose tensor lies past the end of the file
    hdr = json.dumps({"version": v + 1, "tensors": [["model.embed_tokens.weight", "float32", [64, 32], 0, 64 * 32 * 4]]}).encode()
    pathlib.Path(weights_shm.SHM_DIR, lying).write_bytes(weights_shm.MAGIC + len(hdr).to_bytes(8, "little") + hdr)
    try:
        for name in ("/etc/passwd", "../../etc/passwd", str(secret), f"tars-w-{'0' * 12}-v1-1/../../etc/passwd",
                     "tars-w-x", f"tars-w-{'3' * 12}-v9-9\n", link, junk, lying):
            with pytest.raises(grpc.RpcError) as e:
                stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=v + 1, shm=name), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.value.details())
        with pytest.raises(grpc.RpcError) as e:  # a tars name that does not exist here: another host's learner
            stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=v + 1, shm=f"tars-w-{'3' * 12}-v9-9"), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert stub.GetVersion(inference_pb2.GetVersionRequest(), timeout=10).version == v
    finally:
        for n in (link, junk, lying):
            os.unlink(os.path.join(weights_shm.SHM_DIR, n))


def test_segment_round_trip_and_wrong_version():
    sd = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "e": torch.empty(0, 4),
          "t": torch.randn(4, 6).t(), "h": torch.randn(2, 3).half(), "s": torch.tensor(2.5), "w": torch.randn(1, 33)}
    prefix = weights_shm.run_prefix("/nonexistent/run-for-round-trip")
    name = weights_shm.write_segment(prefix, 4, {**sd, "i": torch.arange(5)})
    try:
        version, out = weights_shm.read_segment(name)
        assert version == 4 and set(out) == set(sd) | {"i"}
        for k in sd:
            assert out[k].dtype == sd[k].dtype and torch.equal(out[k], sd[k]), k
        assert out["i"].dtype == torch.float32 and torch.equal(out["i"], torch.arange(5.0))  # stored as float
    finally:
        weights_shm.unlink(name)
    assert segments(prefix) == []


def test_a_segment_that_does_not_fit_is_an_oserror_and_leaves_nothing(monkeypatch):
    """/dev/shm too small for the segment: OSError (the publisher then goes by disk), no half-written file left."""
    def full(fd, off, n):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    prefix = weights_shm.run_prefix("/nonexistent/run-full")
    with pytest.raises(OSError, match="No space"):
        weights_shm.write_segment(prefix, 1, {"a": torch.randn(8)})
    assert segments(prefix) == []


def test_host_copy_is_one_copy_per_publish_into_kept_buffers(tmp_path):
    """HostCopy (learner.publish.host_copy): inside, hf_state_dict (so save_hf, the segment, the stream) answers host
    buffers holding the weights; the same buffers are refilled at the next publish; outside, the policy answers its
    own tensors again. always=True runs the GPU path's logic on this CPU policy."""
    from learner.publish import HostCopy

    policy = tiny()
    host = HostCopy(pinned=True, always=True)
    own = policy.hf_state_dict()
    with host.of(policy):
        first = policy.hf_state_dict()
        assert set(first) == set(own)
        assert all(torch.equal(first[k], own[k]) and first[k].data_ptr() != own[k].data_ptr() for k in own)
        policy.save_hf(tmp_path / "a")
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    assert policy.hf_state_dict()["model.norm.weight"].data_ptr() == own["model.norm.weight"].data_ptr()
    with torch.no_grad():
        for p in policy.lm.parameters():
            p.add_(1.0)
    with host.of(policy):
        second = policy.hf_state_dict()
        assert {k: v.data_ptr() for k, v in second.items()} == ptrs          # refilled, not reallocated
        assert all(torch.equal(second[k], v) for k, v in policy.lm.state_dict().items() if k in second)
        policy.save_hf(tmp_path / "b")
    from safetensors.torch import load_file
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("a", "b"))
    assert all(torch.equal(b[k], a[k] + 1.0) for k in a)                     # the disk copy came from the buffers
    unpinned = HostCopy(pinned=False, always=True)
    with unpinned.of(policy):
        assert unpinned.bufs == {} and all(torch.equal(policy.hf_state_dict()[k], v) for k, v in second.items())
    with HostCopy(pinned=True).of(policy):                                  # on the CPU: nothing to copy
        assert policy.hf_state_dict()["model.norm.weight"].data_ptr() == own["model.norm.weight"].data_ptr()


@pytest.mark.gpu
def test_host_copy_from_cuda_is_pinned_and_exact(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from learner.publish import HostCopy

    policy = tiny().to("cuda")
    host = HostCopy()
    with host.of(policy):
        sd = policy.hf_state_dict()
        assert all(v.device.type == "cpu" and v.is_pinned() for v in sd.values())
        assert all(torch.equal(sd[k], v.cpu()) for k, v in policy.lm.state_dict().items() if k in sd)
    with torch.no_grad():
        for p in policy.lm.parameters():
            p.mul_(2.0)
    with host.of(policy):
        sd = policy.hf_state_dict()
        assert all(torch.equal(sd[k], v.cpu()) for k, v in policy.lm.state_dict().items() if k in sd)


def test_a_header_with_infinite_numbers_is_a_segment_error():
    """json reads Infinity; int(inf) raises OverflowError, which reached the UpdateWeights call as UNKNOWN."""
    prefix = weights_shm.run_prefix("/nonexistent/run-for-inf-header")
    for ent in (["a", "float32", [1], float("inf"), 4], ["a", "float32", [float("inf")], 0, 4],
                ["a", "float32", [1], 0, float("-inf")]):
        name = f"{prefix}v1-1"
        hdr = json.dumps({"version": 1, "tensors": [ent]}).encode()
        pathlib.Path(weights_shm.SHM_DIR, name).write_bytes(weights_shm.MAGIC + len(hdr).to_bytes(8, "little") + hdr)
        try:
            with pytest.raises(weights_shm.SegmentError, match="malformed header: OverflowError"):
                weights_shm.read_segment(name)
        finally:
            weights_shm.unlink(name)
