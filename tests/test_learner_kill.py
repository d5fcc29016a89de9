"""A real `tars learner` process killed with SIGKILL mid-stream and restarted with --resume trains on every
trajectory sent exactly once: real processes, real ZMQ, a sender that keeps unacked trajectories and re-sends them."""
import asyncio
import collections
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from core.model import CausalLM, DecoderConfig
from core.proc import wait_for
from core.schema import Trajectory, Turn
from core.stream.sender import TrajectorySender

ROOT = pathlib.Path(__file__).resolve().parents[1]
N, B, V = 160, 8, 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def traj(i: int) -> Trajectory:
    rng = np.random.default_rng(i)
    n = int(rng.integers(8, 20))
    m = np.zeros(n, np.uint8)
    m[-3:] = 1
    r = float(i % 2)
    return Trajectory(id=f"t{i}", env_id="x", outcome="terminated", tokens=rng.integers(2, V, n).astype(np.int32),
                      logprobs=np.where(m, -1.0, 0).astype(np.float32), versions=np.where(m, 0, -1).astype(np.int32),
                      mask=m, turns=[Turn("", "", {}, r, n - 3, n)], ret=r, success=bool(r))


def read_meta(run):
    """meta.json of the checkpoint a resume would use (a kill mid-swap leaves the previous one in ckpt.old)."""
    from learner.checkpoint import CheckpointError, locate

    try:
        ckpt = locate(run)
        return json.loads((ckpt / "meta.json").read_text()) if ckpt else None
    except (FileNotFoundError, json.JSONDecodeError, CheckpointError):
        return None


def updates(path, start=0, end=None):
    """learner.jsonl lines in bytes [start, end) -> [(version, ids)]: one per policy update."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read() if end is None else f.read(end - start)
    return [(d["version"], d["ids"]) for d in map(json.loads, data.decode().splitlines())]


@pytest.mark.parametrize("durability", ["wal", "checkpoint"])
def test_sigkilled_learner_resumes_and_trains_every_trajectory_once(tmp_path, durability):
    """wal: the restarted learner replays what its WAL acked; checkpoint: the actor re-sends what no checkpoint covered."""
    CausalLM(DecoderConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1)).init_weights(0) \
        .save_hf(tmp_path / "model")
    run, port = tmp_path / "run", free_port()
    run.mkdir()
    cmd = [sys.executable, "-m", "tars.cli", "learner", "--run-dir", str(run), "--model", str(tmp_path / "model"),
           "--set", "learner.algo=grpo", "--set", f"learner.batch_size={B}", "--set", "learner.checkpoint.every=1",
           "--set", f"learner.stream.port={port}", "--set", "learner.staleness.max_lag=100000", "--set", "learner.stream.credits=16",
           "--set", "learner.stream.queue_size=32", "--set", "learner.archive=true", "--set", f"max_versions={N // B}",
           "--set", "learner.group.size=1", "--set", f"learner.stream.durability={durability}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    logs = [open(tmp_path / f"learner{k}.log", "w") for k in (1, 2)]
    first = subprocess.Popen(cmd + ["--ready-file", str(tmp_path / "r1")], env=env, stdout=logs[0], stderr=subprocess.STDOUT,
                             start_new_session=True)
    procs = [first]
    sender_state: dict = {}

    async def send_all():
        s = TrajectorySender(f"tcp://127.0.0.1:{port}", "a0", window=64, heartbeat_s=0.2, dead_after_s=2.0)
        await s.start()
        for i in range(N):
            await s.send(traj(i), timeout=120)  # through the second learner's start
            sender_state["sent"] = i + 1
            await asyncio.sleep(0.01)  # a steady stream, so the kill lands in the middle of it
        await s.flush(timeout=120)
        sender_state["stats"] = s.stats()
        await s.close()

    th = threading.Thread(target=lambda: asyncio.run(send_all()), daemon=True)
    try:
        wait_for(lambda: (tmp_path / "r1").exists(), 120, "first learner did not start")
        th.start()
        meta = wait_for(lambda: (m := read_meta(run)) and m["version"] >= 3 and m, 120, "no checkpoint at version 3")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        sent_at_kill = sender_state.get("sent", 0)
        assert sent_at_kill < N, "the sender finished before the kill: not mid-stream"
        killed_log = (run / "learner.jsonl").stat().st_size
        ckpt = read_meta(run)
        second = subprocess.Popen(cmd + ["--resume", "--ready-file", str(tmp_path / "r2")], env=env, stdout=logs[1],
                                  stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(second)
        assert second.wait(180) == 0, (tmp_path / "learner2.log").read_text()[-3000:]
        th.join(30)
        assert not th.is_alive() and "stats" in sender_state, "sender did not finish"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for f in logs:
            f.close()

    # Trained before the kill and covered by the checkpoint; anything after it was rolled back with the weights.
    v_ckpt = ckpt["version"]
    life1 = [u for u in updates(run / "learner.jsonl", 0, killed_log) if u[0] <= v_ckpt]
    assert [v for v, _ in life1] == list(range(1, v_ckpt + 1))
    before = [tid for _, ids in life1 for tid in ids]
    # The checkpoint lists what life 1 trained, less the ids their actor confirmed forgetting once the log no longer
    # held them (core/stream/confirm.py: never sent again, so not needed to recognise a duplicate); the last update's
    # ids are always there (forgotten only after the checkpoint that lists them: checkpoint.every is 1 here).
    assert set(life1[-1][1]) <= set(ckpt["consumed_ids"]) <= set(before) and len(before) == len(set(before))
    life2 = updates(run / "learner.jsonl", killed_log)
    assert [v for v, _ in life2] == list(range(v_ckpt + 1, N // B + 1))  # resumed at the checkpoint's version
    after = [tid for _, ids in life2 for tid in ids]
    trained = collections.Counter(before + after)
    assert set(trained) == {f"t{i}" for i in range(N)}, sorted({f"t{i}" for i in range(N)} - set(trained))[:10]
    assert max(trained.values()) == 1, [t for t, c in trained.items() if c > 1][:10]
    final = read_meta(run)
    # (the final checkpoint is the second at its version, written at the end: ids confirmed since the first are gone)
    assert final["version"] == N // B and set(final["consumed_ids"]) <= set(trained)
    st = sender_state["stats"]
    assert st["pending"] == 0 and st["held"] == 0 and st["restarts_seen"] == 1
    if durability == "checkpoint":
        assert not (run / "stream.wal").exists()
        # what life 1 held in memory past its checkpoint came again from the actor, not from a log
        assert st["resent"] >= 1
    # the archive (learner.archive) holds each received trajectory once, across both lives
    from learner.data import read_trajectories

    assert sorted(t.id for t in read_trajectories([run / "trajectories.twl"])) == sorted(f"t{i}" for i in range(N))
    assert (run / "final" / "model.safetensors").exists()


def test_a_learner_resumed_behind_the_servers_continues_past_their_version(tmp_path):
    """A killed learner may have published past its last checkpoint; its successor's publishes of the checkpoint's
    version were refused as not newer, so actors kept generating with the dead learner's weights under version
    numbers the new learner then reused. The successor now asks the servers (GetVersion) and continues at their
    version + 1: every version number names one set of weights, and the admission bound stays where it was."""
    from test_inference_server import Servers

    model = CausalLM(DecoderConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1)).init_weights(0)
    model.save_hf(tmp_path / "model")
    run = tmp_path / "run"
    run.mkdir()

    async def main():
        async with Servers() as s:
            _, eng, addr = await s.start(CausalLM.load_hf(tmp_path / "model"), version=5)  # a dead learner's v5
            p = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tars.cli", "learner", "--run-dir", str(run), "--model", str(tmp_path / "model"),
                "--inference", addr, "--resume-or-fresh", "--set", "max_versions=6", "--set", "learner.algo=grpo",
                "--set", f"learner.batch_size={B}", "--set", "inference.auth_token=",
                env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await asyncio.wait_for(p.communicate(), 120)
            return p.returncode, out.decode(), eng.version

    rc, out, served = asyncio.run(main())
    assert rc == 0, out[-3000:]
    assert "resuming at version 0 behind the servers' 5: continuing at 6" in out, out[-3000:]
    assert served == 6  # the learner's weights, under a number the dead learner never used
    assert read_meta(run)["version"] == 6
    assert json.loads((run / "trained.jsonl").read_text().splitlines()[0])["resume"] == 0
