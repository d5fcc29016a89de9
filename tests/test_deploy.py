"""deploy/: systemd units verify, kustomize overlays render and validate, probes are gRPC, sd_notify works."""
from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
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
                      "SystemCallFilter"):
                assert k not in d, f"envd must not set {k} (breaks the bubblewrap sandbox)"
        else:
            assert d["RestrictNamespaces"] == ["yes"] and d["ProtectKernelTunables"] == ["yes"], unit
            assert fams == ["AF_UNIX", "AF_INET", "AF_INET6"], unit


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
SECRET_SETTINGS = ("auth_token", "curve_secret_key", "curve_public_key")


def _secret_values(tmp: pathlib.Path) -> dict[str, str]:
    """A value for every secret file name the deploy files use; CURVE keys are real Z85 keys."""
    import zmq

    pub, sec = zmq.curve_keypair()
    return {"envd-token": "t-envd", "inference-token": "t-inference", "control-token": "t-control",
            "stream-curve-secret": sec.decode(), "stream-curve-public": pub.decode()}


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
            assert cfg.inference.auth_token and cfg.control.auth_token  # publishing weights, its ControlService
        else:
            assert cfg.envd.auth_token and cfg.inference.auth_token and cfg.control.auth_token
            assert cfg.learner.stream.curve_public_key  # the learner's stream is CURVE off loopback
        return cfg

    check(sets)
    if role != "actor":
        with pytest.raises(auth.InsecureBind):
            check([s for s in sets if "_file=" not in s])


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
        for st in _sets(c["args"]):
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
