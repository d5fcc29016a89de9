"""Poisoning the learner from a local process: each attack a process on the same host could make on the trajectory
stream or on the inference server's UpdateWeights, sent over real sockets, and what stops it.

  * untrainable trajectories (token ids outside the vocabulary, non-finite rewards / return / logprobs, rewards or
    returns past MAX_ABS_REWARD, arrays of different lengths) are NACKed "invalid" by the stream, the rest of the stream unaffected, and a real learner
    process trains on the good ones instead of crashing;
  * a non-finite loss or gradient skips both optimiser steps: the weights stay finite;
  * a HELLO claiming 10**12 episodes in flight cannot hold admissions shut;
  * NaN weights and a version jump to 10**12 are refused by the inference server, which keeps serving.
"""
from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import grpc
import msgpack
import numpy as np
import pytest
import torch
from grpc import aio

from core import rpc
from core.config import LearnerConfig, PPOConfig
from core.inference_client import InferenceClient
from core.model import CausalLM, DecoderConfig
from core.proc import wait_for
from core.schema import InvalidTrajectory, Trajectory, Turn
from core.stream import messages as P
from core.v1 import inference_pb2, inference_pb2_grpc
from learner.policy import TrainPolicy
from learner.ppo import PPOTrainer
from learner.staleness import StalenessManager
from test_inference_server import Servers, run
from test_inference_engine import make_model
from test_stream import raw_actor, receiver, recv_until

ROOT = pathlib.Path(__file__).resolve().parents[1]
V = 40
NAN = float("nan")


def good(tid: str, n: int = 12, reward: float = 1.0) -> Trajectory:
    m = np.zeros(n, np.uint8)
    m[-4:] = 1
    return Trajectory(id=tid, env_id="x", outcome="terminated", tokens=(np.arange(n, dtype=np.int32) % (V - 2)) + 2,
                      logprobs=np.where(m, -1.0, 0).astype(np.float32), versions=np.where(m, 0, -1).astype(np.int32),
                      mask=m, turns=[Turn("text:1", "out", {}, reward, n - 4, n)], ret=reward, success=reward > 0)


def frame(tid: str, **change) -> bytes:
    """A hand-built msgpack trajectory, as a fake actor would send it: a good one with some fields replaced."""
    d = good(tid).to_dict()
    d.update(change)
    return msgpack.packb(d, use_bin_type=True)


def tokens(*ids) -> bytes:
    t = good("x").tokens.copy()
    t[-len(ids):] = ids
    return t.astype("<i4").tobytes()


# (id, payload, what the NACK reason says)
POISON = [
    ("oov-1", lambda: frame("oov-1", tokens=tokens(10**9)), "outside the vocabulary"),
    ("oov-2", lambda: frame("oov-2", tokens=tokens(V)), "outside the vocabulary"),
    ("oov-3", lambda: frame("oov-3", tokens=tokens(7, 10**9, 3)), "outside the vocabulary"),
    ("negative", lambda: frame("negative", tokens=tokens(-5)), "negative"),
    ("nan-return", lambda: frame("nan-return", **{"return": NAN}), "return nan is not finite"),
    ("inf-return", lambda: frame("inf-return", **{"return": float("inf")}), "return inf is not finite"),
    ("nan-reward", lambda: frame("nan-reward", turns=[["text:1", "o", {}, NAN, 8, 12, 0.0, 0.0, ""]]), "reward nan"),
    # finite, but past float32's reach in the loss or gradient norm: the whole batch's update was skipped
    ("huge-return", lambda: frame("huge-return", **{"return": 1e30}), "return 1e+30 outside [-1e+06, 1e+06]"),
    ("huge-reward", lambda: frame("huge-reward", turns=[["text:1", "o", {}, -1e30, 8, 12, 0.0, 0.0, ""]]),
     "turn 0's reward -1e+30 outside"),
    ("inf-logprob", lambda: frame("inf-logprob", logprobs=np.full(12, -np.inf, "<f4").tobytes()), "logprobs"),
    ("short-logprobs", lambda: frame("short-logprobs", logprobs=np.zeros(11, "<f4").tobytes()), "logprobs has 11"),
    ("short-versions", lambda: frame("short-versions", versions=np.zeros(13, "<i4").tobytes()), "versions has 13"),
    ("short-mask", lambda: frame("short-mask", mask=np.ones(3, "u1").tobytes()), "mask has 3"),
]


def answers(d, ids, timeout=10.0) -> dict:
    """{id: ("ack" | "nack", reason)} for every id in `ids`, read off a raw actor socket."""
    out: dict = {}
    end = time.monotonic() + timeout
    while set(ids) - set(out) and time.monotonic() < end:
        if not d.poll(50):
            continue
        tag, body = d.recv_multipart()
        b = P.unpack(body)
        if tag == P.NACK:
            out[b["id"]] = ("nack", b["reason"])
        elif tag == P.ACK:
            out.update({t: ("ack", "") for t in b["ids"]})
    assert not set(ids) - set(out), f"no answer for {sorted(set(ids) - set(out))}"
    return out


def refused_between_good_ones(addr: str, name: str, cases, prefix: str, timeout: float = 10.0) -> None:
    """From a raw actor `name`: each case's payload, each followed by a good trajectory ok-i. Every case is NACKed
    with a reason starting with `prefix` and naming its expected text; every good one is acked."""
    d = raw_actor(addr, name.encode())
    d.send_multipart(P.Hello(name, "i", 1).encode())
    recv_until(d, P.WELCOME)
    sent = []
    for i, (tid, payload, _) in enumerate(cases):
        d.send_multipart([P.TRAJ, P.pack({"seq": i, "id": tid}), payload()])
        d.send_multipart([P.TRAJ, P.pack({"seq": 100 + i, "id": f"ok-{i}"}), good(f"ok-{i}").encode()])
        sent += [tid, f"ok-{i}"]
    got = answers(d, sent, timeout)
    d.close()
    for tid, _, why in cases:
        kind, reason = got[tid]
        assert kind == "nack" and reason.startswith(prefix) and why in reason, (tid, got[tid])
    assert all(got[f"ok-{i}"] == ("ack", "") for i in range(len(cases)))


def test_stream_nacks_untrainable_trajectories_and_delivers_the_rest(tmp_path):
    rx = receiver(tmp_path, vocab_size=V)
    refused_between_good_ones(rx.start(), "poisoner", POISON, "invalid: ")
    delivered = [rx.get(timeout=1) for _ in range(len(POISON))]
    assert [t.id for t in delivered] == [f"ok-{i}" for i in range(len(POISON))] and rx.get(timeout=0.2) is None
    s = rx.stats()
    rx.stop()
    assert (s["invalid"], s["malformed"], s["accepted"], s["nacked"]) == (len(POISON), 0, len(POISON), len(POISON))


def test_the_learner_trains_past_out_of_vocabulary_and_nan_trajectories(tmp_path):
    """A real learner process, a fake actor on its stream socket: 3 trajectories with token id 10**9 (an IndexError
    in the embedding, the learner dead, on the old code) and NaN rewards ahead of the good ones."""
    CausalLM(DecoderConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1)).init_weights(0) \
        .save_hf(tmp_path / "model")
    run_dir, B = tmp_path / "run", 4
    run_dir.mkdir()
    cmd = [sys.executable, "-m", "tars.cli", "learner", "--run-dir", str(run_dir), "--model", str(tmp_path / "model"),
           "--ready-file", str(tmp_path / "ready"), "--set", "learner.algo=ppo", "--set", f"learner.batch_size={B}",
           "--set", "max_versions=1", "--set", "learner.group.size=1", "--set", "learner.staleness.max_lag=100"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "learner.log", "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = wait_for(lambda: (tmp_path / "ready").exists() and json.loads((tmp_path / "ready").read_text()), 120,
                         "learner did not start")
        d = raw_actor(ready["stream"], b"poisoner")
        d.send_multipart(P.Hello("poisoner", "i", 1).encode())
        recv_until(d, P.WELCOME, timeout=10)
        bad = [("oov-a", frame("oov-a", tokens=tokens(10**9))), ("oov-b", frame("oov-b", tokens=tokens(10**9))),
               ("oov-c", frame("oov-c", tokens=tokens(10**9))),
               ("nan-r", frame("nan-r", **{"return": NAN}, turns=[["t", "o", {}, NAN, 8, 12, 0.0, 0.0, ""]]))]
        oks = [(f"ok-{i}", good(f"ok-{i}", reward=float(i % 2)).encode()) for i in range(B)]
        for seq, (tid, payload) in enumerate(bad + oks):
            d.send_multipart([P.TRAJ, P.pack({"seq": seq, "id": tid}), payload])
        got = answers(d, [t for t, _ in bad + oks], timeout=20)
        d.close()
        assert all(got[t][0] == "nack" and got[t][1].startswith("invalid: ") for t, _ in bad), got
        assert p.wait(180) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    trained = [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert [sorted(r["ids"]) for r in trained if r.get("version") == 1] == [sorted(t for t, _ in oks)]
    final = TrainPolicy.load(run_dir / "final")
    assert all(torch.isfinite(q).all() for q in final.parameters())


def _nested(depth: int):
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


def _container_bomb(mib: int) -> bytes:
    """A trajectory map whose "turns" are ~mib MiB of 15-element arrays of empty arrays: 1 wire byte per Python list."""
    inner = b"\x9f" + b"\x90" * 15
    n = (mib << 20) // len(inner)
    rest = {k: v for k, v in good("bomb").to_dict().items() if k != "turns"}
    head = b"\xde" + (len(rest) + 1).to_bytes(2, "big") + b"".join(
        msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in rest.items())
    return head + msgpack.packb("turns") + b"\xdd" + n.to_bytes(4, "big") + inner * n


# Frames that once raised past the schema's checks (OverflowError, RecursionError) and killed the receiver's io thread,
# or cost ~70x their size in memory before validation: (id, payload, what the NACK reason says)
MALFORMED = [
    ("inf-turn-end", lambda: frame("inf-turn-end", turns=[["text:1", "o", {}, 1.0, 8, float("inf"), 0.0, 0.0, ""]]),
     "OverflowError"),
    ("inf-boot", lambda: frame("inf-boot", boot_at=float("inf")), "OverflowError"),
    ("nan-start", lambda: frame("nan-start", start_version=NAN), "ValueError"),
    ("inf-segment", lambda: frame("inf-segment", segments=[float("-inf")]), "OverflowError"),
    ("deep-env-id", lambda: frame("deep-env-id", env_id=_nested(1000)), "RecursionError"),
    ("bomb", lambda: frame("bomb") and _container_bomb(8), "msgpack items"),
]


def test_malformed_frames_are_refused_and_the_stream_lives_on(tmp_path):
    """Each MALFORMED frame is NACKed "malformed" and the good trajectory sent after it still arrives: no frame can
    stop the receiver's io thread (before, the first one did, and get() then waited for nothing, for ever)."""
    rx = receiver(tmp_path, vocab_size=V)
    refused_between_good_ones(rx.start(), "mangler", MALFORMED, "malformed: ", timeout=30.0)
    assert [rx.get(timeout=1).id for _ in MALFORMED] == [f"ok-{i}" for i in range(len(MALFORMED))]
    s = rx.stats()
    rx.stop()
    assert (s["malformed"], s["accepted"]) == (len(MALFORMED), len(MALFORMED))


def test_a_container_bomb_costs_bounded_memory_and_a_long_trajectory_still_decodes():
    """msgpack turns each byte of an empty array into a ~60-byte list: an 8 MiB frame of them cost ~580 MiB before
    validation saw it. The decoders now stop at a budget of items (core.schema.unpack_bounded), for trajectories
    and control bodies alike, while an honest 5,000-turn trajectory decodes as before."""
    import tracemalloc

    from core.schema import SchemaError

    tracemalloc.start()
    with pytest.raises(SchemaError, match="msgpack items"):
        Trajectory.decode(_container_bomb(8), 64 << 20, V)
    n = ((8 << 20) - 5) // 16
    body = b"\xdd" + n.to_bytes(4, "big") + (b"\x9f" + b"\x90" * 15) * n  # just under 8 MiB, of lists
    with pytest.raises(P.ProtocolError, match="not msgpack"):
        P.unpack(body)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 100 << 20, f"peak {peak >> 20} MiB"
    n = 5000
    t = good("long", n=4 * n)
    t.turns = [Turn("text:1", "out", {"k": i}, 0.0, 4 * i + 2, 4 * i + 4) for i in range(n)]
    t.mask = np.tile(np.array([0, 0, 1, 1], np.uint8), n)
    t.logprobs = np.where(t.mask, -1.0, 0).astype(np.float32)
    t.versions = np.where(t.mask, 0, -1).astype(np.int32)
    assert len(Trajectory.decode(t.encode(), 64 << 20, V).turns) == n


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death is the point
def test_get_raises_once_the_io_thread_has_died(tmp_path):
    """Whatever kills the io thread, the training loop hears of it from get() (and the learner exits, to be
    restarted) instead of waiting for trajectories that can no longer arrive."""
    rx = receiver(tmp_path, vocab_size=V)

    def broken(msg):
        raise AssertionError("a bug in the receiver")

    rx._handle = broken
    addr = rx.start()
    d = raw_actor(addr, b"a")
    d.send_multipart(P.Hello("a", "i", 1).encode())
    with pytest.raises(RuntimeError, match="io thread crashed: AssertionError..a bug in the receiver"):
        for _ in range(100):
            rx.get(timeout=0.1)
    d.close()
    rx.stop()


def _nan_batch(n: int = 64) -> list[Trajectory]:
    """The attack's batch: rewards (and so returns) NaN; built directly, as the stream would refuse it."""
    out = []
    for i in range(n):
        t = good(f"nan-{i}", reward=NAN)
        out.append(t)
    with pytest.raises(InvalidTrajectory):
        out[0].validate(V)
    return out


def _params(*models) -> list[torch.Tensor]:
    return [q.detach().clone() for m in models if m is not None for q in m.parameters()]


@pytest.mark.parametrize("algo,minibatches,entropy", [("ppo", 1, 0.0), ("ppo", 2, 0.0), ("grpo", 1, 0.01)])
def test_a_nonfinite_loss_skips_both_optimiser_steps(algo, minibatches, entropy):
    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1) if algo == "ppo" else None
    tr = PPOTrainer(pol, critic, LearnerConfig(algo=algo, lr=1e-2, warmup_steps=1,
                                               ppo=PPOConfig(minibatches=minibatches, entropy_coef=entropy)), 0)
    before = _params(pol, critic)
    m = tr.step(_nan_batch(), 0)
    after = _params(pol, critic)
    assert all(torch.isfinite(q).all() for q in after), "NaN reached the weights"
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "an optimiser stepped on a non-finite gradient"
    assert m["nonfinite_steps"] == minibatches and m["policy_step_skipped"]
    assert math.isfinite(tr.entropy_coef)
    if critic is not None:
        assert tr.value_pretrain_step(_nan_batch())["nonfinite_steps"] == 1
        assert all(torch.equal(a, b) for a, b in zip(before, _params(pol, critic)))
    # Training goes on: a clean batch moves the weights, and they stay finite.
    m = tr.step([good(f"ok-{i}", reward=float(i % 2)) for i in range(16)], 1)
    moved = _params(pol, critic)
    assert m["nonfinite_steps"] == 0 and all(torch.isfinite(q).all() for q in moved)
    assert any(not torch.equal(a, b) for a, b in zip(before, moved))
    for opt in (tr.opt, tr.critic_opt):
        for st in (opt.state.values() if opt is not None else ()):
            assert all(torch.isfinite(v).all() for v in st.values() if torch.is_tensor(v))


def test_a_lying_hello_cannot_hold_admissions_shut(tmp_path):
    stal = StalenessManager(batch_size=4, eta=1)        # at most 8 episodes may start at version 0
    rx = receiver(tmp_path, stal=stal, actor_timeout_s=1.5)
    addr = rx.start()
    liar = raw_actor(addr, b"liar")
    liar.send_multipart(P.Hello("liar", "x", 1, [], 10**12).encode())
    recv_until(liar, P.WELCOME)
    stop = threading.Event()

    def keep_pinging():                                 # the liar stays alive, as a live actor would
        while not stop.is_set():
            liar.send_multipart(P.Ping().encode())
            stop.wait(0.05)

    pinger = threading.Thread(target=keep_pinging, daemon=True)
    pinger.start()
    honest = raw_actor(addr, b"honest")
    try:
        honest.send_multipart(P.Hello("honest", "h", 1).encode())
        recv_until(honest, P.WELCOME)
        assert stal.stats()["running"] <= 8             # the claim is capped at what could have been admitted

        def admit(rid: int) -> int:
            honest.send_multipart(P.Admit(rid, 4).encode())
            return recv_until(honest, P.GRANT)[-1][1]["granted"]

        rid, granted, end = 0, 0, time.monotonic() + 10
        while not granted and time.monotonic() < end:   # the claim never arrives: given back, admissions go on
            rid += 1
            granted = admit(rid)
            time.sleep(0.1)
        assert granted == 4
        # The liar again, as a new incarnation, after the start-up window: its word is not taken at all.
        stop.set()
        pinger.join(2)
        liar.send_multipart(P.Hello("liar", "y", 2, [], 10**12).encode())
        recv_until(liar, P.WELCOME)
        assert admit(rid + 1) == 4
        s, st = rx.stats(), stal.stats()
    finally:
        stop.set()
        pinger.join(2)
        liar.close()
        honest.close()
        rx.stop()
    assert (s["claimed"], s["claims_capped"], s["claims_expired"]) == (8, 2, 8)
    assert st["running"] == 8 and st["capacity"] == 0   # the honest actor's 8, nothing of the liar's


def test_an_actor_that_admits_and_never_sends_cannot_hold_admissions_shut(tmp_path):
    """A live peer (it pings) that asks for every admission and never sends an episode held them for good: ADMIT's
    grants not borne out within learner.stream.grant_ttl_s go back to the bound, and the honest actor is admitted."""
    stal = StalenessManager(batch_size=4, eta=1)        # at most 8 episodes may start at version 0
    rx = receiver(tmp_path, stal=stal, grant_ttl_s=1.0)
    addr = rx.start()
    hoarder, honest = raw_actor(addr, b"hoarder"), raw_actor(addr, b"honest")
    stop = threading.Event()
    try:
        hoarder.send_multipart(P.Hello("hoarder", "x", 1).encode())
        recv_until(hoarder, P.WELCOME)
        hoarder.send_multipart(P.Admit(1, 10**6).encode())
        assert recv_until(hoarder, P.GRANT)[-1][1]["granted"] == 8

        def keep_pinging():                             # alive as far as the receiver can tell
            while not stop.is_set():
                hoarder.send_multipart(P.Ping().encode())
                stop.wait(0.05)

        pinger = threading.Thread(target=keep_pinging, daemon=True)
        pinger.start()
        honest.send_multipart(P.Hello("honest", "h", 1).encode())
        recv_until(honest, P.WELCOME)

        def admit(rid: int) -> int:
            honest.send_multipart(P.Admit(rid, 4).encode())
            return recv_until(honest, P.GRANT)[-1][1]["granted"]

        t0 = time.monotonic()
        assert admit(1) == 0                            # the hoarder holds the whole bound
        rid, granted = 1, 0
        while not granted and time.monotonic() < t0 + 10:
            rid += 1
            granted = admit(rid)
            stop.wait(0.05) if not granted else None
        waited = time.monotonic() - t0
        stop.set()
        pinger.join(2)
        s, st = rx.stats(), stal.stats()
    finally:
        stop.set()
        hoarder.close()
        honest.close()
        rx.stop()
    assert granted == 4 and 0.9 < waited < 10, waited   # once the hoarder's grants were a second old
    assert s["grants_expired"] == 8 and s["dead_actors"] == 0 and st["lost"] == 8 and st["running"] == 4


def test_a_peers_ledger_bears_out_claims_first_then_its_oldest_grants():
    from core.stream.peers import Peer

    p = Peer("i", ledger=2, claimed=2, claim_deadline=50.0)   # two episodes claimed in HELLO
    p.grant(10.0, 3)
    p.grant(20.0, 2)
    assert p.ledger == 7 and p.arrived(30.0, 60.0) and (p.claimed, p.ledger) == (1, 6)
    assert p.arrived(31.0, 60.0) and p.arrived(32.0, 60.0)   # the last claim, then the oldest grant
    assert (p.claimed, p.ledger, [list(g) for g in p.grants]) == (0, 4, [[10.0, 2], [20.0, 2]])
    p.finish(1)                                               # lost: the oldest grant again
    assert [list(g) for g in p.grants] == [[10.0, 1], [20.0, 2]]
    assert p.expire(35.0, 20.0) == [("grants_expired", 1)] and p.ledger == 2    # only the grant older than 20 s
    assert p.granted == sum(n for _, n in p.grants) == 2
    assert p.expire(35.0, 0.0) == [] and p.expire(100.0, 0.0) == []              # 0: grants never expire
    q = Peer("j", ledger=3, claimed=3, claim_deadline=5.0)
    assert q.expire(6.0, 1.0) == [("claims_expired", 3)] and q.ledger == 0


def _weights(model: CausalLM, tmp_path, name: str) -> bytes:
    model.save_hf(tmp_path / name)
    return (tmp_path / name / "model.safetensors").read_bytes()


def test_inference_server_refuses_nan_weights_and_version_jumps(tmp_path):
    from safetensors.torch import load as st_load, save as st_save

    good_bytes = _weights(make_model(1), tmp_path, "v1")
    sd = st_load(good_bytes)
    name = next(k for k, v in sd.items() if v.is_floating_point())
    sd[name] = torch.full_like(sd[name], NAN)
    nan_bytes = st_save(sd)

    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start(make_model(0))
            ch = rpc.channel(addr)
            stub = inference_pb2_grpc.InferenceServiceStub(ch)

            async def refused(**req) -> str:
                with pytest.raises(aio.AioRpcError) as ei:
                    await stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(**req), timeout=30)
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
                return ei.value.details()

            assert "non-finite" in await refused(version=1, safetensors=nan_bytes)
            assert "max_version_jump" in await refused(version=10**12, safetensors=good_bytes)
            assert "max_version_jump" in await refused(version=1001, path=str(tmp_path / "v1"))
            c = InferenceClient([addr], retries=0)
            with pytest.raises(aio.AioRpcError) as ei:
                await c.update_weights_streamed(10**12, st_load(good_bytes))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # The previous weights stay served: finite logprobs at version 0.
            r = await c.generate("t", [1, 2, 3], 8, temperature=1.0)
            assert r.versions == [0] * 8 and all(math.isfinite(lp) for lp in r.logprobs)
            assert eng.version == 0 and eng.target_version == 0
            # And the learner's next publish (a path, version + 1) is taken.
            up = await stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=1, path=str(tmp_path / "v1")), timeout=30)
            assert up.version == 1
            r = await c.generate("t2", [1, 2, 3], 8, temperature=1.0)
            assert set(r.versions) == {1} and all(math.isfinite(lp) for lp in r.logprobs)
            await c.close()
            await ch.close()
            # inference.max_version_jump = 0: unbounded (non-finite weights are refused all the same).
            _, eng2, addr2 = await s.start(make_model(0), max_version_jump=0)
            c2 = InferenceClient([addr2], retries=0)
            assert (await c2.update_weights(10**12, data=good_bytes))[0]["version"] == 10**12
            with pytest.raises(aio.AioRpcError) as ei:
                await c2.update_weights(10**12 + 1, data=nan_bytes)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and eng2.version == 10**12
            await c2.close()

    run(main())


def test_the_control_services_update_weights_answers_as_the_rpc_does(tmp_path):
    """`tars ctl`'s update_weights command (ControlService) refuses what UpdateWeights refuses, with the same codes
    (it answered UNKNOWN "Unexpected <class 'WeightLoadError'>" for a missing file), and the served weights stay."""
    from safetensors.torch import load as st_load, save as st_save

    from core.v1 import control_pb2, control_pb2_grpc

    _weights(make_model(1), tmp_path, "v1")
    sd = st_load((tmp_path / "v1" / "model.safetensors").read_bytes())
    name = next(k for k, v in sd.items() if v.is_floating_point())
    sd[name] = torch.full_like(sd[name], NAN)
    _weights(make_model(1), tmp_path, "nan")
    (tmp_path / "nan" / "model.safetensors").write_bytes(st_save(sd))

    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start(make_model(0))
            ch = rpc.channel(addr)
            ctl = control_pb2_grpc.ControlServiceStub(ch)

            async def code(version, path) -> tuple[grpc.StatusCode, str]:
                with pytest.raises(aio.AioRpcError) as ei:
                    await ctl.Command(control_pb2.CommandRequest(name="update_weights", args={
                        "version": str(version), "path": str(path)}), timeout=30)
                return ei.value.code(), ei.value.details()

            c, d = await code(1, tmp_path / "nan")
            assert c == grpc.StatusCode.INVALID_ARGUMENT and "non-finite" in d, d
            assert (await code(1001, tmp_path / "v1"))[0] == grpc.StatusCode.INVALID_ARGUMENT  # max_version_jump
            assert (await code(1, tmp_path / "missing"))[0] == grpc.StatusCode.FAILED_PRECONDITION
            assert (await code(1, "/etc/passwd"))[0] == grpc.StatusCode.FAILED_PRECONDITION
            assert (await code(1, "x" * 5000))[0] == grpc.StatusCode.FAILED_PRECONDITION
            assert (await code("one", tmp_path / "v1"))[0] == grpc.StatusCode.INVALID_ARGUMENT
            assert eng.version == 0
            r = await ctl.Command(control_pb2.CommandRequest(name="update_weights", args={
                "version": "1", "path": str(tmp_path / "v1")}), timeout=30)
            assert json.loads(r.result_json)["version"] == 1 and eng.version == 1
            await ch.close()

    asyncio.run(main())


def test_update_refusal_maps_a_timeout_before_its_base_class_oserror():
    """TimeoutError is an OSError: the RPC's mapping once caught it as an unreadable path (FAILED_PRECONDITION,
    "cannot read ''") instead of DEADLINE_EXCEEDED."""
    from inference_server.answers import update_refusal
    from inference_server.engine_types import EngineClosed, WeightLoadError, WeightsRefused

    assert update_refusal(TimeoutError(), None, 2.0)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert update_refusal(FileNotFoundError(2, "No such file"), "/x", 2.0) == (
        grpc.StatusCode.FAILED_PRECONDITION, "cannot read '/x': No such file")
    assert update_refusal(WeightsRefused("nan"), None, 2.0)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert update_refusal(WeightLoadError("bad"), None, 2.0)[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert update_refusal(EngineClosed("closed"), None, 2.0)[0] == grpc.StatusCode.UNAVAILABLE
    assert update_refusal(RuntimeError("bug"), None, 2.0) is None


def test_one_huge_reward_would_skip_the_whole_update_and_is_refused():
    """A finite reward of 1e30 in one trajectory of sixteen: the update's loss or gradient norm overflows float32 and
    the optimiser step is skipped for every trajectory of the batch, so one such trajectory a batch stalls training.
    validate refuses it; the same batch with it left out steps."""
    batch = [good(f"ok-{i}", reward=float(i % 2)) for i in range(15)]
    huge = good("huge", reward=1e30)
    with pytest.raises(InvalidTrajectory, match=r"return 1e\+30 outside"):
        huge.validate(V)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1)
    tr = PPOTrainer(pol, critic, LearnerConfig(algo="ppo", lr=1e-2, warmup_steps=1), 0)
    assert tr.step(copy.deepcopy(batch) + [huge], 0)["policy_step_skipped"]  # what it did when it was let in
    assert not tr.step(batch, 1)["policy_step_skipped"]
