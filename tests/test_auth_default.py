"""Auth on by default: a run started through tars.topology (`tars up`, `tars eval`, the benchmarks) hands every role
per-run tokens through its 0600 config.yaml (never a command line); control and UpdateWeights need them; `tars ctl`
reads the run's control token; every service refuses a non-loopback bind without its secrets; secrets can come from
files (`*_file`)."""
import json
import os
import pathlib
import stat
import subprocess
import sys

import grpc
import pytest

from core import config as C
from core import rpc
from core.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
U, OK = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK
# A tiny run: one actor with two episodes at a time, and a batch the learner never fills, so nothing trains and no
# weights are published while the test sends its own UpdateWeights.
TINY = ["sft.steps=0", "actor.concurrency=2", "learner.batch_size=4096", "actor.max_turns=2"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tars.up import build_model

    d = tmp_path_factory.mktemp("model")
    path, _ = build_model(C.load("quickstart", None, TINY), d, lambda m: None)
    return path


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
        return OK
    except grpc.RpcError as e:
        return e.code()


def _command(addr: str, token: str, name: str, args: dict | None = None) -> grpc.StatusCode:
    ch = rpc.sync_channel(addr, token)
    try:
        return _code(lambda: control_pb2_grpc.ControlServiceStub(ch).Command(
            control_pb2.CommandRequest(name=name, args=args or {}), timeout=10))
    finally:
        ch.close()


def _update_weights(addr: str, token: str, path: str, version: int) -> grpc.StatusCode:
    ch = rpc.sync_channel(addr, token, 64 << 20)
    try:
        return _code(lambda: inference_pb2_grpc.InferenceServiceStub(ch).UpdateWeights(
            inference_pb2.UpdateWeightsRequest(version=version, path=path), timeout=60))
    finally:
        ch.close()


def _ctl(env: dict, *words: str) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "tars.cli", "ctl", *words], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    return r.returncode, r.stdout if "--json" in words else r.stdout + r.stderr  # stderr: the fallback's warning


def _cmdlines_and_environs() -> dict[str, bytes]:
    """Every readable /proc/PID/cmdline on this machine, and the environment of this user's processes."""
    out = {}
    for p in pathlib.Path("/proc").iterdir():
        if p.name.isdigit():
            for what in ("cmdline", "environ"):
                try:
                    out[f"{p.name}/{what}"] = (p / what).read_bytes()
                except OSError:
                    pass  # gone, or another user's environment
    return out


def _topology_run(model, tmp_path, monkeypatch, full: bool) -> None:
    """A run placed by tars.topology as `tars up` places it: envd and the inference server, and with `full` the
    learner and one actor too (the learner's and the actor's ControlService)."""
    from tars import ctl
    from tars.topology import Topology, plan

    out = tmp_path / "run"
    out.mkdir()
    cfg = C.load("quickstart", None, TINY)
    assert not (cfg.envd.auth_token or cfg.inference.auth_token or cfg.control.auth_token)  # nobody set any
    C.save(cfg, out / "config.yaml")
    with Topology(plan(cfg, out, model, learner=full, n_actors=1 if full else 0)) as topo:
        # per-run tokens, a separate one for control, in the config every role reads, which only its owner can read
        tokens = {"envd": cfg.envd.auth_token, "inference": cfg.inference.auth_token, "control": cfg.control.auth_token}
        assert all(len(t) >= 32 for t in tokens.values()), tokens
        assert len(set(tokens.values())) == 3
        assert stat.S_IMODE((out / "config.yaml").stat().st_mode) == 0o600
        saved = C.load(None, str(out / "config.yaml"))
        assert (saved.envd.auth_token, saved.inference.auth_token, saved.control.auth_token) == tuple(tokens.values())
        topo.start()
        envd, inference = topo.ready[("envd", 0)]["address"], topo.ready[("inference", 0)]["address"]
        roles = ["envd", "inference"]

        # no token anywhere on a command line, nor in any process environment
        for where, data in _cmdlines_and_environs().items():
            for name, t in tokens.items():
                assert t.encode() not in data, f"the {name} token is in /proc/{where}"

        # control: refused without a token and with a service token; the run's control token works
        for token in ("", tokens["envd"], tokens["inference"], "wrong"):
            assert _command(envd, token, "drain") == U, token
            assert _command(inference, token, "update_weights", {"version": "9", "path": str(model)}) == U, token
            if full:
                assert _command(topo.ready[("learner", 0)]["address"], token, "stop") == U, token
                assert _command(topo.ready[("actor", 0)]["address"], token, "pause") == U, token
        assert all(topo.alive().values()), topo.alive()  # nothing stopped
        assert _command(envd, tokens["control"], "drain") == OK
        assert _command(envd, tokens["control"], "undrain") == OK
        if full:
            roles += ["learner", "actor"]
            assert _command(topo.ready[("learner", 0)]["address"], tokens["control"], "set_eta", {"eta": "3"}) == OK

        # `tars ctl` finds the run (as after `tars up`, through the last-run file) and reads its control token
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        monkeypatch.delenv("TARS_RUN", raising=False)
        ctl.remember_run(out)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        rc, text = _ctl(env, "status", "--json")
        assert rc == 0, text
        assert sorted(r["role"] for r in json.loads(text)) == sorted(roles), text
        rc, text = _ctl(env, "drain")
        assert rc == 0 and " ok " in text, text
        if full:
            rc, text = _ctl(env, "set", "eta", "4")
            assert rc == 0 and " ok " in text, text
        rc, text = _ctl(env, "status", "--target", envd)  # an explicit target, no run: no token
        assert rc == 1 and "UNAUTHENTICATED" in text, text

        # UpdateWeights: the inference token only (the control token is not a service token)
        for token in ("", tokens["control"], tokens["envd"]):
            assert _update_weights(inference, token, str(model), 1) == U, token
        assert _update_weights(inference, tokens["inference"], str(model), 1) == OK
        assert all(topo.alive().values()), topo.alive()


def test_a_topology_run_needs_its_tokens_and_tars_ctl_has_them(model, tmp_path, monkeypatch):
    _topology_run(model, tmp_path, monkeypatch, full=False)


@pytest.mark.slow  # four real processes: ~35 s on 2 busy cores
def test_the_learner_and_actor_control_services_need_the_run_control_token(model, tmp_path, monkeypatch):
    _topology_run(model, tmp_path, monkeypatch, full=True)


def test_tokens_set_by_the_user_are_kept(tmp_path):
    from tars import tokens

    cfg = C.load(None, None, ["envd.auth_token=mine-envd", "control.auth_token=mine-control"])
    made = tokens.issue(cfg, tmp_path / "config.yaml")
    assert made == {"envd.auth_token": False, "inference.auth_token": True, "control.auth_token": False,
                    "telemetry.prometheus_token": True, "learner.stream.curve": False,
                    "learner.stream.curve_client_keys": False}  # no learner in this run
    assert cfg.envd.auth_token == "mine-envd" and cfg.control.auth_token == "mine-control"
    assert len(cfg.inference.auth_token) >= 32
    assert stat.S_IMODE((tmp_path / "config.yaml").stat().st_mode) == 0o600
    # a run that uses an envd it did not start (tars eval --envd) does not invent a token for it
    cfg = C.load(None, None, [])
    tokens.issue(cfg, tmp_path / "c2.yaml", envd=False)
    assert cfg.envd.auth_token == "" and cfg.inference.auth_token and cfg.control.auth_token


def test_config_files_are_written_for_their_owner_only(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("{}")
    p.chmod(0o644)
    C.save(C.load(None, None, ["control.auth_token=x"]), p)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and C.load(None, str(p)).control.auth_token == "x"


def _role(tmp_path, name: str, argv: list[str], timeout: float = 60) -> tuple[int | None, str]:
    """Run `tars ARGV` until it exits (or `timeout`: then it is killed, and the exit status is None)."""
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "tars.cli", *argv, "--ready-file", str(tmp_path / f"{name}.json")],
                             cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            rc = None
    return rc, log.read_text()


@pytest.mark.parametrize("sets, missing", [
    ([], "envd.auth_token and control.auth_token"),
    (["control.auth_token=c"], "envd.auth_token"),
])
def test_envd_refuses_a_public_bind_without_tokens(tmp_path, sets, missing):
    argv = ["envd", "--set", "envd.host=0.0.0.0", *[x for s in sets for x in ("--set", s)]]
    rc, out = _role(tmp_path, "envd", argv)
    assert rc == 2 and "not a loopback address" in out and f"without {missing}" in out, (rc, out[-2000:])
    assert not (tmp_path / "envd.json").exists()


def test_inference_server_refuses_a_public_bind_without_tokens(tmp_path, model):
    rc, out = _role(tmp_path, "inference", ["serve", "--model", str(model), "--set", "inference.host=0.0.0.0"])
    assert rc == 2 and "without inference.auth_token and control.auth_token" in out, (rc, out[-2000:])
    rc, out = _role(tmp_path, "inference", ["serve", "--model", str(model), "--set", "inference.host=::",
                                            "--set", "inference.auth_token=t"])
    assert rc == 2 and "control.auth_token" in out, (rc, out[-2000:])


def test_learner_refuses_a_public_stream_without_curve(tmp_path, model):
    rc, out = _role(tmp_path, "learner", ["learner", "--run-dir", str(tmp_path / "run"), "--model", str(model),
                                          "--set", "learner.stream.host=0.0.0.0", "--set", "control.auth_token=c"])
    assert rc == 2 and "trajectory stream" in out and "curve_secret_key" in out, (rc, out[-2000:])


def test_check_listener_rules():
    from core import auth

    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert auth.is_loopback(host), host
        auth.check_listener("envd", "x", host, {"envd.auth_token": ""})  # loopback: allowed (with a warning)
    for host in ("0.0.0.0", "::", "", "10.0.0.11", "envd-0.envd", "192.168.1.2"):
        assert not auth.is_loopback(host), host
        with pytest.raises(auth.InsecureBind, match="envd.auth_token"):
            auth.check_listener("envd", "x", host, {"envd.auth_token": "", "control.auth_token": "c"})
        auth.check_listener("envd", "x", host, {"envd.auth_token": "t", "control.auth_token": "c"})
    from envd.server import check_bind as envd_bind
    from inference_server.server import check_bind as inference_bind
    from learner.main import check_bind as learner_bind

    envd_bind(C.EnvdConfig(host="0.0.0.0", auth_token="t"), "c")
    with pytest.raises(auth.InsecureBind):
        envd_bind(C.EnvdConfig(host="0.0.0.0", auth_token="t"), "")  # the ControlService on it would be open
    inference_bind(C.InferenceConfig(host="0.0.0.0", auth_token="t"), "c")
    import zmq

    key = zmq.curve_keypair()[1].decode()  # a real key: the config refuses one that is not (tests/test_rpc_auth.py)
    cfg = C.load(None, None, ["learner.stream.host=0.0.0.0", f"learner.stream.curve_secret_key={key}"])
    with pytest.raises(auth.InsecureBind, match="curve_client_keys"):  # CURVE without an allowlist of actor keys
        learner_bind(cfg)
    cfg.learner.stream.curve_client_keys = zmq.curve_keypair()[0].decode()
    learner_bind(cfg)


def test_secrets_come_from_files(tmp_path):
    import zmq

    curve = zmq.curve_keypair()[1].decode()
    for name, value in (("envd", "envd-secret"), ("inference", "inf-secret"), ("control", "ctl-secret"),
                        ("curve", curve)):
        (tmp_path / name).write_text(value + "\n")
        (tmp_path / name).chmod(0o600)
    cfg = C.load(None, None, [f"envd.auth_token_file={tmp_path / 'envd'}",
                              f"inference.auth_token_file={tmp_path / 'inference'}",
                              f"control.auth_token_file={tmp_path / 'control'}",
                              f"learner.stream.curve_secret_key_file={tmp_path / 'curve'}"])
    assert (cfg.envd.auth_token, cfg.inference.auth_token, cfg.control.auth_token,
            cfg.learner.stream.curve_secret_key) == ("envd-secret", "inf-secret", "ctl-secret", curve)
    # the same value given both ways (a config saved after reading the file) is fine; two values are not
    C.load(None, None, ["envd.auth_token=envd-secret", f"envd.auth_token_file={tmp_path / 'envd'}",
                        "control.auth_token=c"])
    with pytest.raises(C.ConfigError, match="both set"):
        C.load(None, None, ["envd.auth_token=other", f"envd.auth_token_file={tmp_path / 'envd'}"])
    (tmp_path / "empty").write_text("\n")
    for path, why in ((tmp_path / "absent", "cannot read"), (tmp_path / "empty", "is empty"), (tmp_path, "not a regular")):
        with pytest.raises(C.ConfigError, match=why):
            C.load(None, None, [f"control.auth_token_file={path}"])


def test_tars_ctl_reads_a_control_token_file(tmp_path):
    from tars import ctl

    (tmp_path / "ctl-token").write_text("from-a-file\n")
    C.save(C.load(None, None, [f"control.auth_token_file={tmp_path / 'ctl-token'}"]), tmp_path / "config.yaml")
    assert ctl.run_control_token(str(tmp_path)) == "from-a-file"
    d = tmp_path / "only-file"
    d.mkdir()
    (d / "config.yaml").write_text(f"control:\n  auth_token_file: {tmp_path / 'ctl-token'}\n")
    assert ctl.run_control_token(str(d)) == "from-a-file"


def test_a_missing_token_file_stops_a_role_with_one_line(tmp_path):
    rc, out = _role(tmp_path, "envd", ["envd", "--set", f"envd.auth_token_file={tmp_path / 'nope'}",
                                       "--set", "control.auth_token=c"], timeout=60)
    assert rc == 2 and "envd.auth_token_file" in out and "cannot read" in out, (rc, out[-2000:])


def test_a_run_with_a_learner_gets_a_curve_stream(tmp_path):
    """A run that starts the learner gets a per-run CURVE keypair for its trajectory stream (0600 config.yaml);
    keys the user set are kept; a run without a learner gets none."""
    import zmq

    from tars import tokens

    if not zmq.has("curve"):
        pytest.skip("libzmq built without CURVE")
    cfg = C.load("quickstart")
    made = tokens.issue(cfg, tmp_path / "config.yaml", learner=True)
    assert made["learner.stream.curve"]
    s = C.load(None, str(tmp_path / "config.yaml")).learner.stream
    assert len(s.curve_public_key) == 40 and len(s.curve_secret_key) == 40
    assert zmq.curve_public(s.curve_secret_key.encode()).decode() == s.curve_public_key
    public, secret = zmq.curve_keypair()
    cfg = C.load("quickstart")
    cfg.learner.stream.curve_public_key, cfg.learner.stream.curve_secret_key = public.decode(), secret.decode()
    assert not tokens.issue(cfg, tmp_path / "c2.yaml", learner=True)["learner.stream.curve"]
    assert cfg.learner.stream.curve_secret_key == secret.decode()
    cfg = C.load("quickstart")
    assert not tokens.issue(cfg, tmp_path / "c3.yaml")["learner.stream.curve"]
    assert not cfg.learner.stream.curve_secret_key


def test_a_run_directory_is_the_owners_alone(tmp_path):
    """Trajectories, episodes and logs under a run directory are task data: the directory is 0700. A directory that
    holds something else is not a run's and keeps its mode."""
    import stat

    from tars.topology import prepare

    prepare(tmp_path / "new")
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700 and (tmp_path / "new" / "logs").is_dir()
    other = tmp_path / "home"
    other.mkdir(mode=0o755)
    (other / "notes.txt").write_text("mine")
    prepare(other)
    assert stat.S_IMODE(other.stat().st_mode) == 0o755
