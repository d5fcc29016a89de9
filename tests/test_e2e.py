"""End to end: a short `tars up` with every role a real process; trajectories flow, the version advances,
every process exits and its port is freed, and the report and final checkpoint are written."""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = ["--set", "sft.steps=5", "--set", "learner.batch_size=16",
         "--set", "actor.concurrency=32", "--set", "learner.checkpoint.every=5"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _port_free(addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    with socket.socket() as s:
        try:
            s.bind((host.replace("tcp://", ""), int(port)))
            return True
        except OSError:
            return False


def _run_info(out: pathlib.Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "run").glob("*.json"))]


@pytest.mark.slow  # a whole multi-process run: > 20 s on 2 cores (CI runs the slow set after the default one)
def test_tars_up_short_run(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tars.cli", "up", "--preset", "quickstart", "--out", str(out), "--quiet",
           *SMALL, "--set", "wall_budget_s=25", "--set", "max_versions=1000"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    for key in ("episodes", "success_first", "success_last", "success_sft", "policy_version", "wall_s",
                "trajectories_per_s", "max_staleness"):
        assert key in rep
    assert rep["episodes"] >= 32 and rep["policy_version"] >= 2, rep
    assert rep["max_staleness"] <= 2 + 1  # eta = 2 bounds the lag of a consumed trajectory
    assert (out / "learning.png").stat().st_size > 1000
    assert (out / "final" / "config.json").exists() and (out / "final" / "model.safetensors").exists()
    assert (out / "config.yaml").exists()
    info = _run_info(out)
    assert {d["role"] for d in info} == {"envd", "inference", "learner", "actor"}
    for d in info:
        assert not _alive(d["pid"]), f"{d['role']} (pid {d['pid']}) still running"
        assert _port_free(d["address"]), f"{d['role']} port {d['address']} still bound"
    # the final checkpoint loads in transformers too
    transformers = pytest.importorskip("transformers")
    transformers.AutoModelForCausalLM.from_pretrained(out / "final")


@pytest.mark.slow  # a whole multi-process run: > 20 s on 2 cores (CI runs the slow set after the default one)
def test_tars_up_stops_cleanly_on_ctrl_c(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tars.cli", "up", "--preset", "quickstart", "--out", str(out), "--quiet",
           *SMALL, "--set", "wall_budget_s=600"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:  # wait until episodes flow
            ep = out / "episodes.jsonl"
            if ep.exists() and ep.read_text().count("\n") >= 16:
                break
            assert p.poll() is None, p.stdout.read()
            time.sleep(0.5)
        else:
            pytest.fail("no episodes within 180 s")
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 130  # Ctrl-C: stopped in order, report written, the exit status says interrupted
    assert (out / "report.json").exists() and (out / "final" / "model.safetensors").exists()
    for d in _run_info(out):
        assert not _alive(d["pid"]), f"{d['role']} (pid {d['pid']}) still running"


@pytest.mark.slow  # a whole multi-process run: > 20 s on 2 cores (CI runs the slow set after the default one)
def test_tars_up_serves_a_judge_of_its_own(tmp_path):
    """actor.judge_model: `tars up` starts a server for it beside the policy's; every episode is judged there (a
    random judge's answer rarely parses: judge_on_error=env keeps the env reward then), and it never takes the
    learner's weights, which the policy's server does."""
    from tests.hf_dirs import make_checkpoint

    judge = tmp_path / "judge"
    make_checkpoint(judge, arch="llama", seed=5, vocab_size=400)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tars.cli", "up", "--preset", "quickstart", "--out", str(out), "--quiet", *SMALL,
           "--set", "wall_budget_s=25", "--set", "max_versions=1000", "--set", "learner.archive=true",
           "--set", "actor.judge_mode=add", "--set", f"actor.judge_model={judge}", "--set", "actor.judge_on_error=env"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["policy_version"] >= 2 and rep["episodes"] >= 32, rep
    info = {p.stem: json.loads(p.read_text()) for p in (out / "run").glob("*.json")}
    assert info["judge"]["role"] == "inference" and info["judge"]["address"] != info["inference"]["address"]
    for name, d in info.items():
        assert not _alive(d["pid"]), f"{name} (pid {d['pid']}) still running"
        assert _port_free(d["address"]), f"{name} port {d['address']} still bound"
    from learner.data import read_trajectories

    judged = [t.judge for t in read_trajectories([out / "trajectories.twl"]) if t.outcome != "infra_error"]
    assert len(judged) >= 32 and all(j for j in judged)
    # the judge answered every one (a verdict, or an answer that did not parse): none failed to reach it
    assert all("verdict" in j or "unparseable" in j.get("error", "") for j in judged), judged[:3]
    assert "weights v" in (out / "logs" / "inference.log").read_text()      # the policy's server is updated
    assert "weights v" not in (out / "logs" / "judge.log").read_text()      # the judge's never
