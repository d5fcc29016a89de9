"""Every user error of the `tars` command, tried as a user would (the real CLI in a subprocess): one line on stderr,
no traceback, exit status 2 (user error), 130 (Ctrl-C) or 1 (a failure during the run), and nothing started or
written before the error. Also `tars ctl`'s choice of run: --run, $TARS_RUN, the current directory, and only then the
latest local `tars up`, with a warning."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
ENV.pop("TARS_RUN", None)
ENV.pop("TARS_TRACEBACK", None)


def tars(*args, env=None, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tars.cli", *map(str, args)], cwd=cwd or ROOT, env=env or ENV,
                          capture_output=True, text=True, timeout=timeout)


def one_line(r, cmd: str, code: int = 2, *needles: str) -> str:
    """The command ended with `code` and one `tars CMD:` line on stderr (its last line), no traceback."""
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines, "nothing on stderr"
    mine = [x for x in lines if x.startswith(f"tars {cmd}:")]
    assert mine == [lines[-1]], lines[-5:]
    for n in needles:
        assert n in lines[-1], lines[-1]
    return lines[-1]


# ---- checkpoints: a good one, one without its tokenizer, one whose vocabulary does not fit its tokenizer --------
def _checkpoint(path: pathlib.Path, vocab: int | None = None, tokenizer: bool = True) -> pathlib.Path:
    from core.chat import copy_tokenizer_files
    from core.model import CausalLM, DecoderConfig
    from tars.fresh import shared_tokenizer

    tok = shared_tokenizer()
    dc = DecoderConfig(vocab_size=vocab or tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                       bos_token_id=tok.eot_id, eos_token_id=tok.eot_id, pad_token_id=tok.pad_id)
    CausalLM(dc).init_weights(0, 0.02).save_hf(path)
    if tokenizer:
        copy_tokenizer_files(tok.path, path)
    return path


def _damaged(good: pathlib.Path, path: pathlib.Path, how: str) -> pathlib.Path:
    """A copy of the good checkpoint whose weights are damaged: truncated (a copy cut short), sharded with one shard
    cut short, or without any weights file."""
    import shutil

    from core.model_files import WEIGHTS_NAME, read_weights, write_weights

    shutil.copytree(good, path)
    w = path / WEIGHTS_NAME
    if how == "truncated":
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif how == "shard":
        shards = [n for n in write_weights(path, read_weights(good), max_shard_bytes=20_000) if n.endswith("safetensors")]
        w.unlink()
        last = path / shards[-1]
        last.write_bytes(last.read_bytes()[:-1])
    else:
        w.unlink()
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpts")
    (d / "a-file").write_text("not a directory")
    good = _checkpoint(d / "good")
    return {"good": good, "notok": _checkpoint(d / "notok", tokenizer=False),
            "small": _checkpoint(d / "small", vocab=64), "file": d / "a-file", "missing": d / "missing",
            **{how: _damaged(good, d / how, how) for how in ("truncated", "shard", "noweights")},
            **{name: _edited(good, d / name, file, text) for name, file, text in (
                ("badconfig", "config.json", '{"model_type": "qwen2",'),      # a config.json cut short
                ("zeroheads", "config.json", None),                             # num_attention_heads 0
                ("badgen", "generation_config.json", '{"eos_token_id": '))}}  # cut short


def _edited(good: pathlib.Path, path: pathlib.Path, name: str, text: str | None) -> pathlib.Path:
    """A copy of the good checkpoint with file `name` replaced by text (None: config.json with 0 attention heads)."""
    import shutil

    shutil.copytree(good, path)
    if text is None:
        text = json.dumps({**json.loads((good / name).read_text()), "num_attention_heads": 0})
    (path / name).write_text(text)
    return path


# ---- bad paths ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which,needle", [("missing", "no such directory"), ("file", "a file, not a checkpoint"),
                                          ("notok", "no tokenizer.json"), ("small", "not a pair"),
                                          ("shard", "truncated or corrupt")])
def test_up_model_path_that_cannot_be_used(tmp_path, ckpts, which, needle):
    r = tars("up", "--set", f"model.path={ckpts[which]}", "--out", tmp_path / "run", "--quiet")
    one_line(r, "up", 2, "model.path", needle)
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("cmd,which,needle", [
    *((c, "small", "not a pair") for c in ("sft", "serve", "learner", "eval")),  # the vocabulary check: every command
    ("sft", "missing", "no such directory"), ("learner", "missing", "no such directory"),
    ("serve", "file", "a file, not a checkpoint"), ("sft", "file", "a file, not a checkpoint"),
    ("eval", "missing", "not a checkpoint directory"),
    # weights that cannot be read: exit 1 (sft, eval) or a traceback (serve, learner) once loading, before
    *((c, "truncated", "model.safetensors: its header describes") for c in ("sft", "serve", "learner", "eval")),
    ("serve", "shard", "its header describes"), ("learner", "noweights", "no weights"),
    # a config.json or generation_config.json that is not one: a traceback (serve, learner) or exit 1 before
    ("serve", "badconfig", "config.json cannot be read as a model config"),
    ("learner", "zeroheads", "config.json cannot be read as a model config"),
    ("sft", "badgen", "generation_config.json: not a generation config")])
def test_model_that_cannot_be_used_every_command(tmp_path, ckpts, cmd, which, needle):
    args = {"sft": ["--out", tmp_path / "o", "--demos", "2"], "serve": [],
            "learner": ["--run-dir", tmp_path / "o"], "eval": ["--suite", "builtin", "--out", tmp_path / "o"]}[cmd]
    r = tars(cmd, "--model", ckpts[which], *args)
    one_line(r, cmd, 2, needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("which,needle", [("missing", "no such directory"), ("notok", "no tokenizer.json"),
                                          ("small", "not a pair")])
def test_up_judge_model_that_cannot_be_used(tmp_path, ckpts, which, needle):
    r = tars("up", "--set", "actor.judge_mode=add", "--set", f"actor.judge_model={ckpts[which]}",
             "--out", tmp_path / "run", "--quiet")
    one_line(r, "up", 2, "actor.judge_model", needle)
    assert not (tmp_path / "run").exists()


def test_actor_judge_model_without_its_servers(tmp_path, ckpts):
    r = tars("actor", "--envd", "127.0.0.1:1", "--inference", "127.0.0.1:2", "--stream", "tcp://127.0.0.1:3",
             "--tokenizer", ckpts["good"], "--set", "actor.judge_mode=replace",
             "--set", f"actor.judge_model={ckpts['good']}")
    one_line(r, "actor", 2, "actor.judge_model", "actor.judge_inference=HOST:PORT")


@pytest.mark.parametrize("cmd", ["actor", "eval"])
def test_missing_tokenizer_is_one_line(tmp_path, ckpts, cmd):
    args = (["--envd", "127.0.0.1:1", "--inference", "127.0.0.1:2", "--stream", "tcp://127.0.0.1:3"] if cmd == "actor"
            else ["--suite", "builtin", "--model", "127.0.0.1:5", "--out", tmp_path / "o"])
    one_line(tars(cmd, *args, "--tokenizer", ckpts["notok"]), cmd, 2, "--tokenizer", "no tokenizer.json")


@pytest.mark.parametrize("cmd", ["up", "eval", "sft"])
def test_out_that_cannot_be_written(tmp_path, ckpts, cmd):
    out = ckpts["file"] / "sub"  # under a regular file: no directory can be made there
    args = {"up": ["--quiet"], "eval": ["--suite", "builtin", "--model", "oracle", "--episodes", "1"],
            "sft": ["--model", ckpts["good"], "--demos", "2"]}[cmd]
    one_line(tars(cmd, *args, "--out", out), cmd, 2, "--out", "is a file")


def test_missing_config_file_and_learner_resume_without_checkpoint(tmp_path, ckpts):
    one_line(tars("up", "--config", tmp_path / "nope.yaml", "--out", tmp_path / "r"), "up", 2, "--config", "no such file")
    (tmp_path / "bad.yaml").write_text("actor: [1, 2\n")
    one_line(tars("config", "--config", tmp_path / "bad.yaml"), "config", 2, "cannot be read as YAML")
    (tmp_path / "run").mkdir()
    r = tars("learner", "--run-dir", tmp_path / "run", "--model", ckpts["good"], "--resume", "--set",
             "learner.device=cpu")
    one_line(r, "learner", 2, "--resume: no checkpoint")


# ---- bad config values -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["--set", "learner.nokey=3"], "unknown config key(s) ['nokey'] in learner"),
    (["--set", "actor.concurrency=abc"], "actor.concurrency: 'abc' is not int"),
    (["--set", "actor.concurrency=-5"], "actor.concurrency = -5: must be >= 1"),
    (["--set", "telemetry.sample_ratio=2"], "telemetry.sample_ratio = 2.0: must be in [0, 1]"),
    (["--set", "envd.port=70000"], "envd.port = 70000: must be in [0, 65535]"),
    (["--set", "learner.staleness.eta=-1"], "learner.staleness.eta = -1: must be >= 0"),
    (["--set", "learner.lr=nan"], "learner.lr = nan: must be a finite number"),
    (["--set", "learner.checkpoint.every=0"], "learner.checkpoint.every = 0: must be >= 1"),
    (["--set", "learner.algo=PPO"], "learner.algo = 'PPO': must be one of ppo | grpo"),
    (["--set", "actor.judge_mode=replce"], "actor.judge_mode = 'replce': must be one of off | replace | add"),
    (["--preset", "nope"], "no preset 'nope'"),
    (["--set", "actor.env_ids=[builtin/nope]"], "builtin has no task 'nope'"),
    (["--set", "actor.env_ids=[nosuch/x]"], "no backend serves it"),
])
def test_bad_config_values_are_refused_before_the_run(tmp_path, args, needle):
    r = tars("up", *args, "--out", tmp_path / "run", "--quiet")
    one_line(r, "up", 2, "config error", needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args", [["envd", "--port", "70000"], ["envd", "--port", "-1"],
                                  ["serve", "--model", "m", "--port", "70001"]])
def test_a_port_option_out_of_range_is_refused_not_wrapped(args):
    """--port past 65535 (or below 0) bound port % 65536 before: now a config error, exit 2."""
    one_line(tars(*args), args[0], 2, "config error", f"port = {args[args.index('--port') + 1]}: must be "
             "in [0, 65535]")


@pytest.mark.parametrize("cmd,setting,needle", [("config", "actor.env_ids=[oops", "is not a valid YAML value"),
                                                 ("envd", "learner.lr=*abc", "is not a valid YAML value")])
def test_a_set_value_that_is_not_yaml_is_one_line(cmd, setting, needle):
    """A --set value its setting cannot read (a YAML syntax error) is a config error, exit 2, not a traceback."""
    one_line(tars(cmd, "--set", setting), cmd, 2, "config error", needle)


def test_unknown_key_in_a_yaml_file(tmp_path):
    (tmp_path / "c.yaml").write_text("actor:\n  concurency: 4\n")
    one_line(tars("up", "--config", tmp_path / "c.yaml", "--out", tmp_path / "run"), "up", 2, "['concurency'] in actor")


# ---- tasks without demonstrations --------------------------------------------------------------------------------
def test_sft_demos_on_a_task_without_demonstrations_says_what_to_do(tmp_path, ckpts):
    """The old crash: KeyError "no builtin task 'click-button'" from deep in the warm start. MiniWoB++'s oracle tasks
    now have demonstrations (oracle, noisy:P); a task without an oracle, or confused:P off the builtin tasks, is
    refused in one line."""
    r = tars("sft", "--model", ckpts["good"], "--out", tmp_path / "o", "--demos", "5",
             "--set", "actor.env_ids=[miniwob/click-shape]", "--set", "sft.demonstrator=oracle")
    line = one_line(r, "sft", 2, "'miniwob/click-shape'", "builtin/click", "miniwob/click-button", "tars data split",
                    "tars sft --data")
    assert "KeyError" not in line
    r = tars("up", "--set", "actor.env_ids=[miniwob/click-shape]", "--set", "sft.steps=5", "--out", tmp_path / "r",
             "--quiet")
    one_line(r, "up", 2, "scripted demonstrations exist only for the builtin tasks")
    assert not (tmp_path / "r").exists()
    r = tars("up", "--set", "actor.env_ids=[miniwob/click-button]", "--set", "sft.steps=5",
             "--set", "sft.demonstrator=confused:0.5", "--out", tmp_path / "r", "--quiet")
    one_line(r, "up", 2, "'miniwob/click-button'", "confused demonstrator")
    assert not (tmp_path / "r").exists()


def test_sft_demos_from_an_oracle_that_never_wins_say_so(tmp_path, ckpts):
    """The MiniWoB++ oracle keeps only its won episodes: login-user takes three steps, so within actor.max_turns=1 it
    wins none. That was "the trajectory files hold no trajectory with generated tokens" (no trajectory file was
    given); it names the demonstrator, the episodes and the turn limit, exit 2, and writes nothing."""
    pytest.importorskip("miniwob")
    r = tars("sft", "--model", ckpts["good"], "--out", tmp_path / "o", "--demos", "2", "--steps", "1",
             "--set", "actor.env_ids=[miniwob/login-user]", "--set", "actor.max_turns=1",
             "--set", "sft.demonstrator=oracle", timeout=300)
    one_line(r, "sft", 2, "oracle demonstrator won none of the 2 episodes", "miniwob/login-user", "actor.max_turns=1")
    assert "trajectory files" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_eval_unknown_task_in_a_suite(tmp_path):
    (tmp_path / "s.yaml").write_text("tasks: [builtin/nope]\n")
    r = tars("eval", "--suite", tmp_path / "s.yaml", "--model", "oracle", "--out", tmp_path / "o")
    one_line(r, "eval", 2, "builtin has no task 'nope'")
    assert not (tmp_path / "o").exists()


# ---- the learner's device ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["up", "sft", "learner"])
def test_a_cuda_device_that_is_not_there_is_refused_at_the_start(tmp_path, ckpts, cmd):
    dev = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    args = {"up": ["--out", tmp_path / "o", "--set", "sft.steps=50", "--quiet"],
            "sft": ["--model", ckpts["good"], "--out", tmp_path / "o", "--demos", "50"],
            "learner": ["--model", ckpts["good"], "--run-dir", tmp_path / "o"]}[cmd]
    t0 = time.monotonic()
    r = tars(cmd, *args, "--set", f"learner.device={dev}")
    one_line(r, cmd, 2, f"learner.device={dev!r}")
    assert not (tmp_path / "o").exists() and time.monotonic() - t0 < 90  # before any demonstration or model (a start alone: ~40 s on a loaded 2-core host)


# ---- Ctrl-C ------------------------------------------------------------------------------------------------------
def _interrupt(args, ready, cwd=None) -> tuple[int, str, str]:
    # SIGINT back to its default in the child: a test run started in the background (`cmd &` in a script) has it
    # ignored, and a child inherits that, so the Ctrl-C under test would never arrive.
    p = subprocess.Popen([sys.executable, "-m", "tars.cli", *map(str, args)], cwd=cwd or ROOT, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        out = []
        deadline = time.monotonic() + 90
        for line in p.stdout:
            out.append(line)
            if ready in line or time.monotonic() > deadline:
                break
        assert any(ready in x for x in out), "".join(out)[-2000:] + p.stderr.read()[-2000:]
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=90)
        return p.returncode, "".join(out) + rest, err
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_ctrl_c_during_sft_leaves_no_partial_model(tmp_path, ckpts):
    rc, out, err = _interrupt(["sft", "--model", ckpts["good"], "--out", tmp_path / "o", "--demos", "20",
                               "--steps", "100000", "--set", "sft.batch_size=4", "--set", "learner.device=cpu"],
                              "sft on cpu")
    r = subprocess.CompletedProcess([], rc, out, err)
    one_line(r, "sft", 130, "interrupted", "nothing written")
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o.tmp*"))


def test_ctrl_c_during_the_warm_start_of_up(tmp_path):
    rc, out, err = _interrupt(["up", "--out", tmp_path / "r", "--set", "sft.steps=100000", "--set",
                               "learner.device=cpu"], "SFT warm start")
    one_line(subprocess.CompletedProcess([], rc, out, err), "up", 130, "interrupted", "before training started")
    assert (tmp_path / "r" / "config.yaml").exists() and not list((tmp_path / "r").glob("run/*.json"))  # none started
    assert not (tmp_path / "r" / "report.json").exists()


def test_ctrl_c_while_up_starts_its_processes_starts_no_more(tmp_path):
    """Ctrl-C once envd is up (the learner and actors not yet started): the start stops there, what was started is
    stopped, the report says interrupted, exit 130 (it used to start every role and train before stopping)."""
    out = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-m", "tars.cli", "up", "--preset", "quickstart", "--out", str(out),
                          "--set", "sft.steps=0", "--set", "wall_budget_s=300", "--quiet"], cwd=ROOT, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        while not (out / "run" / "envd.json").exists():
            assert time.monotonic() < deadline and p.poll() is None, p.stderr.read()[-2000:] if p.poll() else "slow"
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        so, se = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    one_line(subprocess.CompletedProcess([], p.returncode, so, se), "up", 130, "interrupted", "report in")
    assert not (out / "logs" / "actor0.log").exists()  # no actor was started
    assert json.loads((out / "report.json").read_text())["status"].startswith("interrupted")
    for f in (out / "run").glob("*.json"):  # whatever was started has exited
        pid = json.loads(f.read_text())["pid"]
        assert not pathlib.Path(f"/proc/{pid}").exists() or \
            pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", f.name


def test_ctrl_c_during_eval_writes_results_and_resumes(tmp_path):
    (tmp_path / "s.yaml").write_text("episodes: 400\ntasks: [builtin/click, builtin/menu]\n")
    rc, out, err = _interrupt(["eval", "--suite", tmp_path / "s.yaml", "--model", "oracle", "--out", tmp_path / "o",
                               "--concurrency", "1"], "[tars eval]")
    one_line(subprocess.CompletedProcess([], rc, out, err), "eval", 130, "interrupted after", "rerun the same command")
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["complete"] is False and 0 < res["overall"]["episodes"] < 800
    lines = (tmp_path / "o" / "episodes.jsonl").read_text().splitlines()
    assert len(lines) == res["overall"]["episodes"] and all(json.loads(x) for x in lines)  # whole records only


# ---- tars ctl: which run ------------------------------------------------------------------------------------------
def _fake_run(d: pathlib.Path) -> pathlib.Path:
    """A run directory whose one process (envd) has exited: ctl reports it DOWN without waiting."""
    p = subprocess.Popen(["true"])
    p.wait()
    (d / "run").mkdir(parents=True)
    (d / "run" / "envd.json").write_text(json.dumps({"role": "envd", "address": "127.0.0.1:1", "pid": p.pid}))
    return d


def test_ctl_prefers_run_flag_env_and_cwd_and_warns_on_the_global_fallback(tmp_path):
    a, b, elsewhere = _fake_run(tmp_path / "a"), _fake_run(tmp_path / "b"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = tars("ctl", "status", env=env, cwd=elsewhere)
    one_line(r, "ctl", 2, "no run found", "--run DIR")
    last = tmp_path / "cache" / "tars" / "last-run"
    last.parent.mkdir(parents=True)
    last.write_text(json.dumps({"run_dir": str(a), "pid": 1, "started": 0}))

    r = tars("ctl", "status", env=env, cwd=elsewhere)  # only the global file: used, with a warning naming it
    assert r.returncode == 1 and f"# run {a} " in r.stdout and "DOWN: process" in r.stdout, r.stdout + r.stderr
    warn = [x for x in r.stderr.splitlines() if x.startswith("tars ctl: warning:")]
    assert len(warn) == 1 and str(a) in warn[0] and "--run DIR" in warn[0] and "TARS_RUN" in warn[0], r.stderr
    for how, kw in (("cwd", dict(env=env, cwd=b)), ("$TARS_RUN", dict(env={**env, "TARS_RUN": str(b)}, cwd=elsewhere)),
                    ("--run", dict(env=env, cwd=elsewhere))):
        extra = ["--run", str(b)] if how == "--run" else []
        r = tars("ctl", "status", *extra, **kw)
        assert r.returncode == 1 and "DOWN: process" in r.stdout and str(a) not in r.stdout, (how, r.stdout)
        assert "warning" not in r.stderr and "Traceback" not in r.stderr, (how, r.stderr)
    assert "TARS_RUN" in tars("ctl", "status", env={**env, "TARS_RUN": str(b)}, cwd=a).stdout  # $TARS_RUN beats cwd


def test_ctl_is_not_fooled_by_a_run_whose_out_is_named_run(tmp_path):
    """`tars up --out run` puts report.json in ./run: ctl from that directory once took ./run for a run's ready
    files and failed with KeyError: 'address'. A JSON file without an address is not a ready file either."""
    env = {**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    (tmp_path / "here" / "run").mkdir(parents=True)
    (tmp_path / "here" / "run" / "report.json").write_text(json.dumps({"episodes": 3}))
    one_line(tars("ctl", "status", env=env, cwd=tmp_path / "here"), "ctl", 2, "no run found")
    d = _fake_run(tmp_path / "r")
    (d / "run" / "notes.json").write_text(json.dumps(["not", "a", "ready", "file"]))
    r = tars("ctl", "status", "--run", d, env=env)
    assert r.returncode == 1 and "DOWN: process" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr


def test_a_port_in_use_is_one_line_naming_the_setting(tmp_path):
    """envd, the inference server and the learner's stream on a port something else holds: exit 2 and one line
    naming the setting (a traceback and exit 1 before), and `tars up` says why its role did not start."""
    import socket

    from core.config import UserError
    from core.stream.receiver import TrajectoryReceiver
    from learner.staleness import StalenessManager

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        one_line(tars("envd", "--port", port), "envd", 2, f"127.0.0.1:{port} (envd.port)", "in use")
        rx = TrajectoryReceiver(f"tcp://127.0.0.1:{port}", str(tmp_path / "wal"), StalenessManager(8, 2))
        with pytest.raises(UserError, match=r"learner\.stream\.host, \.port\): Address already in use"):
            rx.start()
        rx.stop()
        r = tars("up", "--preset", "quickstart", "--set", "sft.steps=0", "--set", f"envd.port={port}",
                 "--out", tmp_path / "run", "--quiet", timeout=180)
        assert r.returncode != 0 and f"envd exited with 2 before it was ready: tars envd: cannot bind 127.0.0.1:{port} " \
            "(envd.port)" in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]
    finally:
        held.close()


def test_arguments_refused_before_work_instead_of_after_it(tmp_path):
    """A soak too short for its samples fails at once with the minimum (it failed after the whole run), `tars data
    split` of a missing file leaves no empty output directory, and `tars ctl` with no command asks for status."""
    r = tars("bench", "soak", "--minutes", "0.5", "--every", "5")
    assert r.returncode == 2 and "use --minutes 0.83 or more" in r.stderr, r.stderr
    one_line(tars("data", "split", tmp_path / "missing.twl", "--out", tmp_path / "d0"), "data", 2, "does not exist")
    assert not (tmp_path / "d0").exists()
    r = tars("ctl", "--target", "127.0.0.1:1", "--timeout", "2")
    assert r.returncode == 1 and "ERROR DOWN: cannot reach 127.0.0.1:1" in r.stdout, r.stdout + r.stderr


def test_tars_config_does_not_print_secrets(tmp_path):
    (tmp_path / "c.yaml").write_text("envd:\n  auth_token: sekrit-envd-123\ncontrol:\n  auth_token: sekrit-ctl-456\n"
                                     "learner:\n  stream:\n    curve_secret_key: sekrit-curve-789000000000000000000000000\n")
    r = tars("config", "--config", tmp_path / "c.yaml")
    assert r.returncode == 0 and "sekrit" not in r.stdout + r.stderr and '"auth_token": "<set>"' in r.stdout
    assert '"auth_token": ""' in r.stdout                          # inference's, unset, shows as it is


def test_weights_check_reads_only_headers_and_names_what_is_wrong(tmp_path, ckpts):
    """core.model_files.check_weights: a whole checkpoint (single file or shards) passes; a file cut inside its
    header, a header that is not JSON, trailing bytes, a shard missing a mapped tensor are ValueError / MissingWeights."""
    from core.model_files import MissingWeights, check_weights

    check_weights(ckpts["good"])
    sharded = _damaged(ckpts["good"], tmp_path / "sharded", "shard")
    last = max(sharded.glob("model-*.safetensors"))
    whole = (ckpts["good"] / "model.safetensors").read_bytes()
    for data, needle in [(whole[:100], "not a whole safetensors file"), (b"", "not a whole safetensors file"),
                         (whole[:8] + b"x" * (len(whole) - 8), "not a JSON mapping"),
                         (whole + b"\0", "the file holds")]:
        d = tmp_path / f"c{len(data)}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(data)
        with pytest.raises(ValueError, match=needle):
            check_weights(d)
    last.unlink()
    with pytest.raises(MissingWeights, match="lists shards that are not there"):
        check_weights(sharded)


def test_up_quiet_says_on_stderr_why_the_supervisor_ended_the_run(tmp_path):
    """A role that died more often than supervisor.max_restarts ends the run: `tars up --quiet` exits 1 with the
    reason as one line on stderr (it printed nothing: the reason was only on the progress screen), and report.json's
    status holds the same reason."""
    out = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-m", "tars.cli", "up", "--preset", "quickstart", "--out", str(out),
                          "--set", "sft.steps=0", "--set", "wall_budget_s=300", "--set", "supervisor.max_restarts=0",
                          "--set", "evaluation.episodes=0", "--quiet"], cwd=ROOT, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not list((out / "run").glob("actor*.json")):  # every role is up: the supervisor watches them
            assert time.monotonic() < deadline and p.poll() is None, p.stderr.read()[-2000:] if p.poll() else "slow"
            time.sleep(0.05)
        os.kill(json.loads((out / "run" / "envd.json").read_text())["pid"], signal.SIGKILL)
        so, se = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 1 and "Traceback" not in so + se, (p.returncode, se[-2000:])
    lines = [x for x in se.splitlines() if "died 1 times (supervisor.max_restarts=0)" in x]
    assert len(lines) == 1 and lines[0].startswith("[tars up] ") and "envd" in lines[0], se[-2000:]
    status = json.loads((out / "report.json").read_text())["status"]
    assert "envd died 1 times (supervisor.max_restarts=0)" in status, status


@pytest.mark.parametrize("args,needle", [
    (["eval", "--suite", "builtin", "--model", "random", "--out", "o", "--concurrency", "0"], "--concurrency: '0': an integer >= 1"),
    (["eval", "--suite", "builtin", "--model", "random", "--out", "o", "--concurrency", "-3"], "an integer >= 1"),
    (["sft", "--model", "m", "--out", "o", "--data", "d.twl", "--demos", "-5"], "--demos: '-5': an integer >= 0"),
])
def test_a_count_option_below_its_least_is_a_usage_error(args, needle, capsys):
    """`tars eval --concurrency 0` (or -3) ran one episode at a time and `tars sft --demos -5` rolled none, without a
    word; each is now refused by argparse (status 2) before anything runs."""
    from tars.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(args)
    assert e.value.code == 2 and needle in capsys.readouterr().err
    assert build_parser().parse_args([*args[:-1], "1"]).__dict__[args[-2].lstrip("-")] == 1
