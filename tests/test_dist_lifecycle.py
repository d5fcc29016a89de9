"""The learner under `accelerate launch` (2 gloo ranks): an idle stream longer than the process group's timeout, and
SIGTERM to every process of the job (after its first update), end as one process would: every version trained /
final checkpoint and export."""
import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from core.model import CausalLM, DecoderConfig
from core.stream.sender import TrajectorySender
from test_learner_kill import V, free_port, traj, wait_for  # tests/ is on sys.path (rootless test dir)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _start(tmp_path, *sets):
    CausalLM(DecoderConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1)).init_weights(0) \
        .save_hf(tmp_path / "model")
    port, run = free_port(), tmp_path / "run"
    run.mkdir()
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "tars.cli", "learner",
           "--run-dir", str(run), "--model", str(tmp_path / "model"), "--set", "learner.batch_size=8",
           "--set", f"learner.stream.port={port}", "--set", "learner.staleness.max_lag=100000",
           "--set", "learner.group.size=1", "--ready-file", str(tmp_path / "ready")]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd, env=env, stdout=open(tmp_path / "out.log", "w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    return p, port, run


async def _send(port, lo, hi):
    s = TrajectorySender(f"tcp://127.0.0.1:{port}", "a0", window=64)
    await s.start()
    for i in range(lo, hi):
        await s.send(traj(i), timeout=60)
    await s.flush(timeout=60)
    await s.close()


def _versions(run):
    f = run / "learner.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def _finish(p, tmp_path, timeout=90):
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    return rc, (tmp_path / "out.log").read_text()[-4000:]


@pytest.mark.slow
def test_idle_longer_than_the_process_group_timeout_keeps_the_job(tmp_path):
    p, port, run = _start(tmp_path, "max_versions=3", "learner.dist_timeout_s=6")
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), 120, "learner did not start")
        asyncio.run(_send(port, 0, 8))
        wait_for(lambda: any(r.get("version") == 1 for r in _versions(run)), 60, "first version not trained")
        # Idle past the process group's timeout (6 s): rank 1 waits in a broadcast all along, kept alive by rank 0.
        try:
            wait_for(lambda: p.poll() is not None, 15, "job still running")
            pytest.fail("the job ended while idle")
        except TimeoutError:
            pass
        asyncio.run(_send(port, 8, 24))
    finally:
        rc, log = _finish(p, tmp_path)
    assert rc == 0, log
    assert [r["version"] for r in _versions(run) if "ids" in r and r["ids"]] == [1, 2, 3], log


@pytest.mark.slow
@pytest.mark.parametrize("how", ["every-process", "learner-stop"])
def test_sigterm_checkpoints_and_exports(tmp_path, how):
    p, port, run = _start(tmp_path, "max_versions=1000", "learner.checkpoint.every=1000")
    stopper = None
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), 120, "learner did not start")
        asyncio.run(_send(port, 0, 16))
        wait_for(lambda: any(r.get("version") == 1 for r in _versions(run)), 60, "first version not trained")
        if how == "learner-stop":  # what the deploy files' stop runs: SIGTERM to the ranks, then wait for the launcher
            stopper = subprocess.run([sys.executable, "-m", "tars.cli", "learner-stop", str(p.pid), "--timeout", "90"],
                                     capture_output=True, text=True, timeout=120,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        else:  # every process of the job: the launcher and both ranks (a stop that signals the whole group)
            pids = subprocess.run(["pgrep", "-g", str(p.pid)], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGTERM)
                except ProcessLookupError:
                    pass
    finally:
        rc, log = _finish(p, tmp_path)
    if how == "learner-stop":
        # the ranks return, so the launcher exits 0 as after a finished run (signalled itself it exits 1)
        assert stopper.returncode == 0 and "its ranks" in stopper.stdout, (stopper.stdout, stopper.stderr)
        assert rc == 0, log
    else:
        # The launcher re-raises the SIGTERM it got (torch elastic's SignalException: rc 1) after its ranks exit;
        # what matters is that they did not die: rank 0 checkpointed and exported, no rank failed.
        assert rc is not None and "ChildFailedError" not in log and "Connection closed by peer" not in log, log
    trained = max(r["version"] for r in _versions(run) if r.get("ids"))
    assert (run / "final").is_dir(), log
    assert json.loads((run / "ckpt" / "meta.json").read_text())["version"] == trained, log
