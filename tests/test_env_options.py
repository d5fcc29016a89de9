"""Env options are checked by each backend's own parser, ahead of any session (envd.registry.check_options): an
unknown name or a bad value is refused with a message naming it, by `tars up` / `tars eval` before anything
starts and by the factories themselves (builtin, miniwob and desktop used to ignore unknown names silently)."""
import asyncio
import pathlib
import subprocess
import sys
import time

import grpc
import pytest

from core import config as C
from core.config import ConfigError
from core.v1 import env_pb2
from envd import builtin, desktop, registry
from envd_compliance import envd_client, expect_code, run
from tars import checks
from tars import evalsuite as S

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (ROOT / "core" / "presets").glob("*.yaml"))

# env id, options the backend documents (all accepted together), an option with a bad value
BACKENDS = [
    ("builtin/click", {"max_steps": "5", "strict_targets": "1", "step_delay": "fixed:0.01"}, ("max_steps", "zero")),
    ("miniwob/click-button", {"action_space": "shi17", "max_steps": "10", "episode_time_s": "600",
                              "data_mode": "test", "boxes": "0", "max_text_chars": "1500", "command_timeout_s": "20"},
     ("data_mode", "exam")),
    ("desktop", {"width": "640", "height": "480", "apps": "xterm,xcalc", "max_steps": "3", "settle_s": "0",
                 "instruction": "write a note", "command_timeout_s": "5"}, ("apps", "firefox")),
    ("terminal", {"task": "hello", "max_steps": "4", "verify": "step", "screen_chars": "1000", "timeout_s": "2",
                  "wait_s": "5", "nproc": "64", "disk_mb": "100"}, ("verify", "sometimes")),
    ("gym/CartPole-v1", {"render": "0", "max_episode_steps": "10", "decimals": "2", "obs_chars": "500",
                         "kwargs": "{}"}, ("render", "maybe")),
    ("hybrid", {"width": "640", "height": "480", "apps": "xterm", "settle_s": "0", "verify": "step", "max_steps": "3",
                "instruction": "x", "wait_s": "5", "task": "hello"}, ("width", "wide")),
    ("browser", {"html": "<p>x</p>", "width": "800", "height": "600", "format": "jpeg", "quality": "50",
                 "max_steps": "3", "boxes": "1", "settle_ms": "0", "timeout_s": "5"}, ("format", "gif")),
    ("games/snake", {"step_ms": "50", "max_steps": "4", "width": "400", "height": "400", "boxes": "0"},
     ("step_ms", "0")),
]
IDS = [b[0] for b in BACKENDS]


def _message(env_id: str, options: dict) -> str:
    with pytest.raises(ValueError) as e:
        registry.check_options(env_id, options)
    return str(e.value)


@pytest.mark.parametrize("env_id, good, bad", BACKENDS, ids=IDS)
def test_every_backend_checks_its_options_without_a_session(env_id, good, bad):
    registry.check_options(env_id, good)                         # the documented options, all at once
    registry.check_options(env_id, {})
    msg = _message(env_id, {**good, "bogus": "1"})
    assert "'bogus'" in msg and any(k in msg for k in good)       # names the typo and what it could have been
    key, value = bad
    assert key in _message(env_id, {**good, key: value})


def test_every_builtin_backend_has_a_checker():
    prefixes = ("builtin", "miniwob", "desktop", "terminal", "gym", "hybrid", "browser", "games")
    assert {e.split("/")[0] for e in IDS} == set(prefixes)
    for p in prefixes:
        assert registry._lookup(p)[2][2] is not None, p


def test_check_options_unknown_id_and_a_backend_without_checker():
    with pytest.raises(KeyError, match="no backend serves it"):
        registry.check_options("nobackend/x", {})
    registry.register("test-unchecked", lambda name, options: None, [""])
    try:
        registry.check_options("test-unchecked", {"anything": "goes"})   # nothing to check it with
    finally:
        registry.unregister("test-unchecked")


def test_remote_options_as_a_create_session_carries_them():
    registry.check_options("builtin/click", {"hint_policy": "oracle"}, remote=True)   # the daemon's own option
    with pytest.raises(ValueError, match="hint_policy"):
        registry.check_options("builtin/click", {"hint_policy": "psychic"}, remote=True)
    with pytest.raises(ValueError, match="workspace"):
        registry.check_options("desktop", {"workspace": "/tmp/x"}, remote=True)
    registry.check_options("desktop", {"workspace": "/tmp/x"})   # in-process (hybrid gives its desktop one)


def test_factories_that_ignored_unknown_options_refuse_them():
    for make in (lambda o: builtin.make("click", o), lambda o: registry.make("builtin/click", o),
                 lambda o: desktop.make("", o)):   # desktop: refused before Xvfb or any tool is looked for
        with pytest.raises(ValueError, match=r"option\(s\) \['bogus'\]"):
            make({"bogus": "1"})
    with pytest.raises(ValueError, match="strict_targets"):
        builtin.make("click", {"strict_targets": "maybe"})   # was: any unknown word meant off
    env = builtin.make("click", {})
    with pytest.raises(ValueError, match=r"unknown builtin option\(s\) \['bogus'\]"):
        env.reset(1, {"bogus": "1"})
    env.reset(1, {"strict_targets": "1", "max_steps": "2"})
    assert env.strict_targets and env.max_steps == 2


def test_miniwob_factory_refuses_unknown_options_before_chromium():
    pytest.importorskip("miniwob")
    from envd import miniwob_backend

    with pytest.raises(ValueError, match=r"unknown miniwob option\(s\) \['boxess'\]"):
        miniwob_backend.make("click-button", {"boxess": "0"})


def test_envd_answers_invalid_argument_for_an_unknown_builtin_option():
    async def body():
        async with envd_client() as c:
            e = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="builtin/click", options={"bogus": "1"})))
            assert "bogus" in e.details()
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click"))).session_id
            e = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.Reset(env_pb2.ResetRequest(
                session_id=sid, seed=1, options={"bogus": "1"})))
            assert "bogus" in e.details()
    run(body())


# ---- pre-flight: presets, shipped suites, tars up, tars eval ---------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_presets_pass_the_check(preset):
    cfg = C.load(preset, None, [])
    checks.env_ids(cfg.actor.env_ids)
    checks.env_options(cfg.actor.env_ids, cfg.actor.env_options)


def test_shipped_suites_pass_the_check_with_the_default_config_and_their_presets():
    base = C.load(None, None, []).actor.env_options
    for name in S.available():
        S.check_env_ids(S.load_suite(name), base)
    S.check_env_ids(S.load_suite("builtin"), C.load("quickstart", None, []).actor.env_options)
    for name in ("miniwob", "miniwob-oracle"):
        S.check_env_ids(S.load_suite(name), C.load("miniwob", None, []).actor.env_options)


def test_a_suite_option_typo_is_a_suite_error(tmp_path):
    p = tmp_path / "suite.yaml"
    p.write_text("tasks:\n  - {env: builtin/click, options: {max_stepz: 3}}\n")
    with pytest.raises(S.SuiteError, match=r"suite.yaml: task 'builtin/click'.*\['max_stepz'\]"):
        S.check_env_ids(S.load_suite(str(p)))
    with pytest.raises(S.SuiteError, match=r"actor.env_options.*\['bogus'\]"):
        S.check_env_ids(S.load_suite("builtin"), {"bogus": "1"})


def test_up_preflight_refuses_a_typo_in_env_options(tmp_path, monkeypatch):
    from tars import cli

    monkeypatch.setattr(registry, "missing_programs", lambda env_id: [])   # a host without chromium too

    def preflight(*sets):
        a = cli.build_parser().parse_args(["up", "--preset", "miniwob", "--out", str(tmp_path / "run"),
                                           *[x for s in sets for x in ("--set", s)]])
        cli.preflight(a, cli._load(a))

    preflight()
    with pytest.raises(ConfigError, match=r"actor.env_options for miniwob/click-button: unknown miniwob option\(s\) "
                                          r"\['boxess'\]"):
        preflight("actor.env_options.boxess=0")
    with pytest.raises(ConfigError, match="boxes: not a boolean"):
        preflight("actor.env_options.boxes=sometimes")


def test_up_sft_and_eval_name_the_missing_host_programs_before_anything_starts(tmp_path, monkeypatch, capsys):
    """`tars up` runs envd here, `tars sft --demos` rolls the envs here: a backend's missing program (chromium,
    bubblewrap, socat, Xvfb) is one line naming the env id and the programs before any work, not an infra error at
    the first session after the checkpoint was built."""
    from core.config import UserError
    from tars import cli

    monkeypatch.setenv("PATH", str(tmp_path))               # nothing found on PATH
    assert registry.missing_programs("builtin/click") == [] and registry.missing_programs("gym/CartPole-v1") == []
    assert {"socat", "bwrap", "prlimit"} <= set(registry.missing_programs("miniwob/click-button"))
    assert "bwrap" in registry.missing_programs("terminal/hello")
    assert {"bwrap", "Xvfb", "xdotool"} <= set(registry.missing_programs("desktop"))
    assert "Xvfb" in registry.missing_programs("hybrid/hello")

    def preflight(*argv):
        a = cli.build_parser().parse_args(list(argv))
        cli.preflight(a, cli._load(a))

    with pytest.raises(UserError,
                       match=r"actor.env_ids: miniwob/click-button needs .*socat.*, not installed on this host"):
        preflight("up", "--preset", "miniwob", "--out", str(tmp_path / "run"))
    preflight("up", "--preset", "quickstart", "--out", str(tmp_path / "run"))   # builtin: needs nothing
    assert not (tmp_path / "run").exists()

    # `tars eval` runs envd here too unless --envd names another: its suite's tasks are checked the same way.
    from tars import eval as tars_eval

    suite = tmp_path / "suite.yaml"
    suite.write_text("name: mine\nmax_turns: 3\ntasks: [builtin/click, miniwob/click-button]\n")
    argv = ["eval", "--suite", str(suite), "--model", "random", "--out", str(tmp_path / "ev")]
    a = cli.build_parser().parse_args(argv)
    assert tars_eval.main(a, cli._load(a)) == 2
    err = capsys.readouterr().err
    assert "task 'miniwob/click-button' (envd runs on this host" in err and "socat" in err, err
    assert not (tmp_path / "ev").exists()
    from tars import evalsuite

    evalsuite.check_env_ids(evalsuite.load_suite(str(suite), 1, None), {}, local=False)   # a remote envd: its hosts


def test_eval_refuses_a_typo_in_env_options_before_starting_anything(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tars.cli", "eval", "--suite", "builtin", "--model", "random",
                        "--tasks", "builtin/click", "--episodes", "4", "--out", str(tmp_path / "o"),
                        "--set", "actor.env_options.bogus=1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tars eval: ") and "['bogus']" in lines[0], r.stderr
    assert "task 'builtin/click'" in lines[0] and "actor.env_options" in lines[0]
    assert not (tmp_path / "o").exists() and time.monotonic() - t0 < 90  # a start alone: ~40 s on a loaded 2-core host


def test_scripted_baselines_get_the_configs_env_options(tmp_path):
    """random/oracle sessions are made with actor.env_options under the task's options, as a model's are: a menu
    task (two steps) cannot be won with max_steps=1."""
    from tars import eval as E

    cfg = C.load(None, None, ["actor.env_options.max_steps=1"])
    suite = S.load_suite("builtin", episodes=2, only=["builtin/menu"])
    res = asyncio.run(E.evaluate(suite, E.ScriptedPolicy("oracle", cfg), tmp_path / "o", say=None))
    assert res["overall"]["episodes"] == 2 and res["overall"]["success_rate"] == 0.0



def test_sft_demos_preflight_refuses_a_typo_in_env_options(tmp_path):
    """`tars sft --demos N` plays the demonstrator in this process with actor.env_options: a typo there is refused
    at pre-flight, as in tars up, not after the model is loaded."""
    from hf_dirs import make_checkpoint
    from tars import cli

    make_checkpoint(tmp_path / "m")

    def preflight(*sets):
        a = cli.build_parser().parse_args(["sft", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o"),
                                           "--demos", "4", "--set", "actor.env_ids=[builtin/click]",
                                           *[x for s in sets for x in ("--set", s)]])
        cli.preflight(a, cli._load(a))

    preflight()
    with pytest.raises(ConfigError, match=r"unknown builtin option\(s\) \['bogus'\]"):
        preflight("actor.env_options.bogus=1")
