"""Operating a live `tars up` run: every `tars ctl` command against the real processes (found without flags through
the run file), the Prometheus endpoints scraped and parsed, and the span files of the four processes joined into one
trace (episode -> envd step and generate across processes -> the learner step that links to it).

The policy is a fixture built here: a one-token-context model (decoder blocks zeroed, so logits depend only on the
current token) that answers the prompt's assistant marker with the single token `wait()` and then stops. It is
served, sampled and trained by the real inference server and learner; it only guarantees that every turn parses,
so envd steps happen without a slow SFT warm start.
"""
import contextlib
import io
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from core import config as C
from core import rpc
from core.v1 import env_pb2, env_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def wait_policy(path: pathlib.Path) -> pathlib.Path:
    """A hand-set model that answers `wait()` to every prompt: each token's embedding is a unit vector and the output
    projection maps it to the next token of the chain [end of the generation prompt, wait() ..., end of turn]."""
    from core.chat import copy_tokenizer_files
    from core.model import CausalLM, DecoderConfig
    from tars.fresh import shared_tokenizer

    tok = shared_tokenizer()
    chain = [tok.first_prompt("", "x")[-1], *tok.answer("wait()")]
    assert len(set(chain)) == len(chain)
    c = DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024, rope_theta=100.0,
                      tie_word_embeddings=False, bos_token_id=tok.eot_id, eos_token_id=tok.eot_id, pad_token_id=tok.pad_id)
    m = CausalLM(c).init_weights(0, 0.02)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                p.zero_()  # blocks add nothing: the last hidden state is the current token's embedding
        e = m.model.embed_tokens.weight
        m.lm_head.weight.zero_()
        for i, (prev, nxt) in enumerate(zip(chain, chain[1:])):
            u = torch.zeros(32)
            u[i] = 1.0
            e[prev] = u
            m.lm_head.weight[nxt] = 8.0 * u   # logit ~45 for the next token of the chain, 0 for the rest
    m.save_hf(path)
    copy_tokenizer_files(tok.path, path)
    return path


def ctl(*args, env, cwd, timeout=30) -> tuple[int, str]:
    """`tars ctl ARGS` in this process (the same code path as the command, without a Python start-up per call)."""
    from tars import cli

    old_env, old_cwd, buf = dict(os.environ), os.getcwd(), io.StringIO()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(buf):
            rc = cli.main(["ctl", *args])
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
    return rc, buf.getvalue()


def ctl_process(*args, env, cwd, timeout=30) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "tars.cli", "ctl", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def ctl_json(*args, env, cwd) -> list[dict]:
    rc, out = ctl(*args, "--json", env=env, cwd=cwd)
    assert rc == 0, out
    return json.loads(out)


def by_role(results: list[dict]) -> dict[str, dict]:
    return {r["role"]: r for r in results}


def poll(fn, timeout: float, what: str, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def scrape(address: str, token: str = "") -> dict:
    req = urllib.request.Request(f"http://{address}/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        out: dict[str, list[tuple[dict, float]]] = {}
        for fam in text_string_to_metric_families(r.read().decode()):  # prometheus_client's parser
            for smp in fam.samples:
                out.setdefault(smp.name, []).append((smp.labels, smp.value))
        return out


def value(samples: dict, name: str, **labels) -> float:
    rows = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert rows, f"{name}{labels} not in the scrape ({sorted(samples)[:40]})"
    return rows[0]


@pytest.mark.slow  # a whole multi-process run: > 20 s on 2 cores (CI runs the slow set after the default one)
def test_live_run_ctl_metrics_and_joined_traces(tmp_path):
    model = wait_policy(tmp_path / "policy")
    out = tmp_path / "run"
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    env.pop("TARS_RUN", None)
    cmd = [sys.executable, "-m", "tars.cli", "up", "--preset", "quickstart", "--out", str(out), "--quiet",
           "--set", f"model.path={model}", "--set", "sft.steps=0", "--set", "learner.batch_size=8",
           "--set", "actor.concurrency=16", "--set", "wall_budget_s=50", "--set", "learner.checkpoint.every=1000",
           "--set", "telemetry.sample_ratio=1.0", "--set", "telemetry.prometheus_port=0"]
    up = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        poll(lambda: len(list((out / "run").glob("actor*.json"))) == 1, 120, "the actor's ready file")
        info = {json.loads(p.read_text())["role"]: json.loads(p.read_text()) for p in (out / "run").glob("*.json")}
        assert set(info) == {"envd", "inference", "learner", "actor"}

        # status, found through the run file alone (cwd is not the run directory, no flags)
        def learner_moved():
            st = by_role(ctl_json("status", env=env, cwd=elsewhere))
            return st if st["learner"]["version"] >= 2 and st["envd"]["metrics"]["steps"] > 0 else None
        st = poll(learner_moved, 60, "two policy updates and some envd steps")
        assert set(st) == {"envd", "inference", "learner", "actor"}
        lm = st["learner"]["metrics"]
        assert lm["staleness"]["eta"] == 2 and "queue" in lm and lm["staleness_histogram"]["tokens"] > 0
        assert st["inference"]["metrics"]["tokens_generated"] > 0 and "idle_share" in st["inference"]["metrics"]
        assert st["actor"]["metrics"]["episodes"] > 0 and st["actor"]["metrics"]["paused"] is False
        assert "sessions" in st["envd"]["metrics"]
        rc, text = ctl_process("status", env=env, cwd=elsewhere)  # the real command, as a user runs it
        assert rc == 0 and f"# run {out}" in text and "tokens/s=" in text and "staleness mean=" in text, text

        # set eta N, live
        r = ctl_json("set", "eta", "3", env=env, cwd=elsewhere)
        assert r == [{"target": info["learner"]["address"], "role": "learner", "ok": True, "message": "ok", "result": {"eta": 3}}]
        assert by_role(ctl_json("status", env=env, cwd=elsewhere))["learner"]["metrics"]["staleness"]["eta"] == 3
        r = subprocess.run([sys.executable, "-m", "tars.cli", "ctl", "set", "eta", "-1"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "eta must be an integer >= 0" in r.stderr and not r.stdout, r

        # pause: the actor stops starting episodes; checkpoint is written even while no data flows
        assert ctl_json("pause", env=env, cwd=elsewhere)[0]["result"] == {"paused": True}
        poll(lambda: by_role(ctl_json("status", env=env, cwd=elsewhere))["actor"]["metrics"]["running"] == 0, 30,
             "running episodes to finish after pause")
        r = ctl_json("checkpoint", "--run", str(out), env=env, cwd=elsewhere)[0]
        assert r["role"] == "learner" and r["result"]["requested"] is True
        meta = poll(lambda: (out / "ckpt" / "meta.json").exists() and json.loads((out / "ckpt" / "meta.json").read_text()),
                    30, "the requested checkpoint")
        assert meta["version"] >= 2

        # sessions list | kill, on a session this test opens; drain refuses new ones, undrain accepts again
        run_cfg = C.load(None, str(out / "config.yaml"))  # the per-run tokens `tars up` made (mode 0600)
        assert run_cfg.envd.auth_token and run_cfg.control.auth_token
        envd = env_pb2_grpc.EnvServiceStub(rpc.sync_channel(info["envd"]["address"], run_cfg.envd.auth_token))
        sid = envd.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/mixed", seed=1), timeout=10).session_id
        listed = ctl_json("sessions", "list", env=env, cwd=elsewhere)[0]["result"]
        assert sid in [s["id"] for s in listed]
        r = ctl_json("sessions", "kill", sid, env=env, cwd=elsewhere)[0]
        assert r["ok"] and r["result"]["id"] == sid
        assert sid not in [s["id"] for s in ctl_json("sessions", env=env, cwd=elsewhere)[0]["result"]]
        rc, text = ctl("kill-session", "no-such-session", env=env, cwd=elsewhere)
        assert "FAILED unknown session 'no-such-session'" in text and rc == 1, (rc, text)  # refused: exit 1
        assert ctl_json("drain", env=env, cwd=elsewhere)[0]["result"]["draining"] is True
        with pytest.raises(grpc.RpcError) as e:
            envd.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/mixed"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        (tmp_path / "control-token").write_text(run_cfg.control.auth_token)  # a --target alone sends no token
        assert by_role(ctl_json("status", "--target", info["envd"]["address"], "--token-file", str(tmp_path / "control-token"),
                                env=env, cwd=elsewhere))["envd"]["metrics"]["draining"]
        assert ctl_json("undrain", env=env, cwd=elsewhere)[0]["result"]["draining"] is False
        envd.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/mixed"), timeout=10)

        assert ctl_json("resume", env=env, cwd=elsewhere)[0]["result"] == {"paused": False}
        n0 = by_role(ctl_json("status", env=env, cwd=elsewhere))["actor"]["metrics"]["episodes"]
        poll(lambda: by_role(ctl_json("status", env=env, cwd=elsewhere))["actor"]["metrics"]["episodes"] > n0 + 8, 60,
             "episodes after resume")

        # Prometheus endpoints of every role, parsed: each needs the run's telemetry.prometheus_token (tars up)
        mtoken = C.load(None, str(out / "config.yaml")).telemetry.prometheus_token
        assert len(mtoken) >= 32
        with pytest.raises(urllib.error.HTTPError) as e401:
            scrape(info["learner"]["metrics"])
        assert e401.value.code == 401
        lrn = scrape(info["learner"]["metrics"], mtoken)
        assert value(lrn, "tars_learner_trajectories_total", role="learner") > 0
        assert value(lrn, "tars_learner_eta", role="learner") == 3
        buckets = sorted((float(lab["le"]), v) for lab, v in lrn["tars_token_staleness_bucket"])
        assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1][0] == float("inf")
        assert buckets[-1][1] == value(lrn, "tars_token_staleness_count") > 0
        assert value(lrn, "tars_learner_step_duration_seconds_count") >= 2
        assert "tars_learner_buffer_depth" in lrn and "tars_learner_trajectories_per_s" in lrn
        inf = scrape(info["inference"]["metrics"], mtoken)
        assert value(inf, "tars_inference_tokens_total", role="inference") > 0
        assert 0.0 <= value(inf, "tars_inference_idle_share") <= 1.0
        ev = scrape(info["envd"]["metrics"], mtoken)
        assert value(ev, "tars_env_step_duration_seconds_count", role="envd") > 0
        act = scrape(info["actor"]["metrics"], mtoken)
        assert value(act, "tars_actor_episodes_total", outcome="truncated") > 0
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
        log = up.communicate(timeout=120)[0]
    assert up.returncode in (0, 130), log[-3000:]  # budget reached, or Ctrl-C (130)

    # the run is over: no-flag ctl says so at once, a dead --target within the deadline
    rc, text = ctl_process("status", env=env, cwd=elsewhere)
    assert rc == 1 and text.count("DOWN: process") == 4, text
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    rc, text = ctl("pause", "--target", dead, "--timeout", "3", env=env, cwd=elsewhere)
    assert rc == 1 and f"DOWN: cannot reach {dead}" in text and time.monotonic() - t0 < 30, text

    # the report has the throughput and staleness figures and the plots
    rep = json.loads((out / "report.json").read_text())
    assert rep["trajectories_per_s_peak"] > 0 and rep["episode_staleness_mean"] is not None
    assert (out / "learning.png").stat().st_size > 20_000

    # span files of the four processes join: one trace holds the actor's episode, the envd process's step (child
    # of the actor's env.step) and the inference process's generate (child of the actor's generate), and a learner
    # step links to that episode
    spans = [json.loads(line) for f in (out / "telemetry").glob("spans-*.jsonl") for line in f.open()]
    assert {s["service"] for s in spans} == {"actor", "envd", "inference", "learner"}
    by_id = {s["span_id"]: s for s in spans}
    episodes = {s["trace_id"]: s for s in spans if s["name"] == "episode"}
    linked = {(lk["trace_id"], lk["span_id"]) for s in spans if s["name"] == "learner.step" for lk in s["links"]}
    joined = []
    for tid, ep in episodes.items():
        if (tid, ep["span_id"]) not in linked:
            continue
        trace = [s for s in spans if s["trace_id"] == tid]
        env_steps = [s for s in trace if s["name"] == "envd.step" and s["service"] == "envd"]
        gens = [s for s in trace if s["name"] == "inference.generate" and s["service"] == "inference"]
        if env_steps and gens:
            joined.append((ep, env_steps, gens))
    assert joined, "no trace joins an episode, an envd step, a generation and a learner step"
    ep, env_steps, gens = joined[0]
    client = by_id[env_steps[0]["parent_span_id"]]
    assert client["name"] == "env.step" and client["service"] == "actor" and client["kind"] == "CLIENT"
    turn = by_id[client["parent_span_id"]]
    assert turn["name"] == "turn" and turn["parent_span_id"] == ep["span_id"]
    gclient = by_id[gens[0]["parent_span_id"]]
    assert gclient["name"] == "generate" and gclient["service"] == "actor"
    assert env_steps[0]["kind"] == "SERVER" and env_steps[0]["pid"] == info["envd"]["pid"]
    assert ep["attributes"]["tars.trajectory_id"] and ep["attributes"]["tars.outcome"] in ("terminated", "truncated")
