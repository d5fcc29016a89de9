"""SGLang as a managed backend of the inference server: `tars serve --engine sglang` launching and supervising
servers (real processes: the conformance stand-in run as the SGLang module) or attaching to running ones, the
start-up deadline, grpc.health.v1 following the replicas, and the flags the launcher and the k8s overlay pass,
checked against SGLang 0.5.23's own parser."""
from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from core.config import InferenceConfig
from inference_server.engine import SamplingParams
from inference_server.sglang_launch import SGLangStartupError, server_command
from test_sglang import DC, PROMPT, greedy, models  # noqa: F401 - fixtures
from test_sglang_pool import _free_port_run

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLAGS = ROOT / "tests" / "data" / "sglang_0.5.23_flags.tsv"
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "gpu" / "inference-sglang.yaml"
CONFORMANCE = "inference_server.sglang_conformance"
SERVICE = "tars.v1.InferenceService"


def _free_port() -> int:
    """A port free now, below the ephemeral range: a port the kernel handed out (bind 0) and released can be taken
    by another process's client socket before the server launched on it binds it."""
    return _free_port_run(1)


def _serve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:  # a start on a loaded 2-core host: ~30 s
    """`tars serve ...`; stderr without the loopback-without-tokens warning of tars.auth (not what is tested here)."""
    r = subprocess.run([sys.executable, "-m", "tars.cli", "serve", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    r.stderr = "".join(ln for ln in r.stderr.splitlines(True) if " tars.auth WARNING " not in ln)
    return r


# ---- start-up: fail fast, in one line ----------------------------------------------------------------
def test_serve_exits_2_with_one_line_when_no_sglang_server_answers(models):  # noqa: F811
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    r = _serve("--model", models["a"], "--port", "0", "--engine", "sglang", "--sglang-url", f"http://127.0.0.1:{port}",
               "--set", "inference.sglang_startup_timeout_s=1")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"inference_server: no SGLang server answered /health_generate at http://127.0.0.1:{port} within 1 s"], r.stderr
    assert time.monotonic() - t0 < 120  # the 1 s set, not the 900 s default (the process start alone took 34 s on a loaded host)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_launching_sglang_off_loopback_is_refused_before_launch(models, host):  # noqa: F811
    """A launched SGLang server's HTTP API takes no token: off loopback it is refused, exit 2, one line, and nothing
    listens on its port (it bound 0.0.0.0 and answered /pause_generation to anyone before)."""
    from core.auth import InsecureBind
    from inference_server.sglang_launch import SGLangFleet, launch_sglang_servers

    port = _free_port()
    r = _serve("--model", models["a"], "--port", "0", "--engine", "sglang", "--sglang-launch", "1",
               "--set", f"inference.sglang_module={CONFORMANCE}", "--set", f"inference.sglang_base_port={port}",
               "--set", f"inference.sglang_host={host}", "--set", "inference.sglang_startup_timeout_s=30")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"inference_server: inference.sglang_host={host!r}: refusing to launch SGLang servers off loopback: their "
        "HTTP API (update_weights_from_disk, pause_generation, generate) takes no token, so anyone who can reach this "
        "host could use it. Bind 127.0.0.1 (remote actors call the tars front, guarded by inference.auth_token)"], r.stderr
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # no server was started
    with pytest.raises(InsecureBind):
        SGLangFleet(InferenceConfig(max_context=256, engine="sglang", sglang_launch=1, sglang_host=host), models["a"])
    with pytest.raises(InsecureBind):
        launch_sglang_servers(models["a"], 256, host=host, base_port=port, module=CONFORMANCE)
    SGLangFleet(InferenceConfig(max_context=256, engine="sglang", sglang_launch=1, sglang_host="localhost"), models["a"])  # loopback


@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--host=::"], ["--hos", "0.0.0.0"], ["--ho=0.0.0.0"],
                                  ["--mem-fraction-static", "0.8", "--host", "::"]])
def test_sglang_args_cannot_move_a_launched_server_off_loopback(args):
    """The launcher's --host comes before sglang_args, and SGLang's parser keeps the last one (or an unambiguous
    prefix of it): a --host there bound the tokenless HTTP API to every address, past check_host's refusal."""
    from core.auth import InsecureBind
    from inference_server.sglang_launch import SGLangFleet, launch_sglang_servers

    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_launch=1, sglang_host="127.0.0.1", sglang_args=args)
    with pytest.raises(InsecureBind, match="sglang_args"):
        SGLangFleet(cfg, "/nonexistent-model")
    with pytest.raises(InsecureBind, match="sglang_args"):
        launch_sglang_servers("/nonexistent-model", 256, extra_args=args, module=CONFORMANCE, wait_s=1)
    SGLangFleet(InferenceConfig(max_context=256, engine="sglang", sglang_launch=1, sglang_args=["--mem-fraction-static", "0.8"]),
                "/nonexistent-model")  # other flags pass


def test_serve_exits_2_at_once_when_a_launched_server_dies_before_it_is_healthy(models):  # noqa: F811
    # the checkpoint is fine (tars serve checks it first); the server's Python fails at once, exit status 1
    t0 = time.monotonic()
    r = _serve("--model", models["a"], "--port", "0", "--engine", "sglang", "--sglang-launch", "1",
               "--set", f"inference.sglang_module={CONFORMANCE}", "--set", f"inference.sglang_base_port={_free_port()}",
               "--set", "inference.sglang_python=/bin/false", "--set", "inference.sglang_startup_timeout_s=600",
               "--set", "inference.max_context=256")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]  # before it: the dead server's own output
    assert last.startswith("inference_server: SGLang server http://127.0.0.1:") and "exited with status 1 before it " \
        "answered /health_generate" in last and CONFORMANCE in last, r.stderr
    assert time.monotonic() - t0 < 120  # not the 600 s deadline (a process start alone can take 30 s on a loaded host)
    assert "Traceback" not in r.stderr.split("inference_server: SGLang server")[-1]


def test_engine_config_mistakes_are_one_line_errors(models):  # noqa: F811
    r = _serve("--model", models["a"], "--port", "0", "--engine", "sglang")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "inference_server: engine=sglang needs inference.sglang_urls (base URLs of running SGLang servers) or "
        "inference.sglang_launch (how many to start on the model directory)"], r.stderr
    r = _serve("--model", models["a"], "--port", "0", "--engine", "sglang", "--sglang-launch", "1", "--sglang-url",
               "http://127.0.0.1:9")
    assert r.returncode == 2 and "not both" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---- health follows the replicas; a dead launched server is restarted ----------------------------------
async def _health(address: str, service: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from core import rpc

    ch = rpc.channel(address)
    try:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    finally:
        await ch.close()


async def _until(address: str, status: str, timeout: float) -> float:
    t0 = time.monotonic()
    while (s := await _health(address, SERVICE)) != status:
        assert time.monotonic() - t0 < timeout, f"{SERVICE} still {s} after {timeout} s, expected {status}"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_launched_servers_are_supervised_and_health_follows_them(models):  # noqa: F811
    """The front launches a conformance server as its SGLang; SIGKILL its process group: the InferenceService turns
    NOT_SERVING (process alive: "" stays SERVING), the supervisor restarts it on its port, SERVING again, and it
    generates; closing the engine ends the group."""
    from core.inference_client import InferenceClient
    from inference_server.server import InferenceServer, make_engine

    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_launch=1, sglang_module=CONFORMANCE,
                          sglang_base_port=_free_port(), sglang_startup_timeout_s=120, sglang_health_interval_s=0.2,
                          sglang_health_timeout_s=2, sglang_restart_backoff_s=0.1, sglang_max_restarts=2)

    async def main():
        eng = await asyncio.to_thread(make_engine, cfg, models["a"])
        srv = InferenceServer(cfg, eng, model_name="sglang")
        await srv.start()
        client = InferenceClient([srv.address])
        pids = []
        try:
            assert await _health(srv.address, SERVICE) == "SERVING"
            r = await client.generate("t", PROMPT, 4, temperature=0.0)
            assert r.output_ids == greedy(models["a"], PROMPT, 4)[0]
            (st,) = eng.fleet.status()
            pids.append(st["pid"])
            os.killpg(st["pid"], signal.SIGKILL)
            await _until(srv.address, "NOT_SERVING", 10)
            assert await _health(srv.address, "") == "SERVING"
            await _until(srv.address, "SERVING", 120)
            (st,) = eng.fleet.status()
            assert st["restarts"] == 1 and st["pid"] != pids[0] and not st["given_up"]
            pids.append(st["pid"])
            r = await client.generate("t", PROMPT, 4, temperature=0.0)
            assert r.output_ids == greedy(models["a"], PROMPT, 4)[0]
            assert eng.metrics()["server_restarts"] == 1
        finally:
            await client.close()
            await srv.stop()
            await asyncio.to_thread(eng.close)
        return pids

    pids = asyncio.run(asyncio.wait_for(main(), 240))  # two server starts, ~15 s each on a loaded 2-core host
    assert all(_gone(p) for p in pids)


def test_health_follows_an_attached_server_killed_and_restarted(models):  # noqa: F811
    from inference_server.server import InferenceServer, make_engine

    port = _free_port()
    cmd = server_command(models["a"], "127.0.0.1", port, 0, module=CONFORMANCE)
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[f"http://127.0.0.1:{port}"],
                          sglang_startup_timeout_s=120, sglang_health_interval_s=0.2, sglang_health_timeout_s=2)

    async def main(procs):
        procs.append(subprocess.Popen(cmd, start_new_session=True))
        eng = await asyncio.to_thread(make_engine, cfg, models["a"])  # waits for its /health_generate
        srv = InferenceServer(cfg, eng, model_name="sglang")
        await srv.start()
        try:
            assert await _health(srv.address, SERVICE) == "SERVING"
            os.killpg(procs[-1].pid, signal.SIGKILL)
            procs[-1].wait(10)
            await _until(srv.address, "NOT_SERVING", 10)
            procs.append(subprocess.Popen(cmd, start_new_session=True))
            await _until(srv.address, "SERVING", 120)
            out = await asyncio.to_thread(eng.generate, PROMPT, SamplingParams(max_new_tokens=3, temperature=0.0), "t")
            assert out.output_ids == greedy(models["a"], PROMPT, 3)[0]
        finally:
            await srv.stop()
            await asyncio.to_thread(eng.close)

    procs: list[subprocess.Popen] = []
    try:
        asyncio.run(asyncio.wait_for(main(procs), 240))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def test_startup_deadline_in_process_names_every_url():
    from inference_server.sglang_start import open_sglang_engine

    urls = [f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"]
    with pytest.raises(SGLangStartupError, match=f"at {urls[0]}, {urls[1]} within 0.5 s"):
        open_sglang_engine(InferenceConfig(engine="sglang", sglang_urls=urls, sglang_startup_timeout_s=0.5))


# ---- the flags, against SGLang 0.5.23's parser ---------------------------------------------------------
def _sglang_flags() -> dict[str, str]:
    """flag -> arity ("0" a switch, "1" one value, else argparse nargs): SGLang's own parser where the package is
    importable, else the copy of 0.5.23's flag list in tests/data."""
    try:
        import argparse

        from sglang.srt.server_args import ServerArgs  # a GPU machine with sglang installed
    except Exception:  # noqa: BLE001 - absent, or present without its GPU dependencies
        rows = [ln.split("\t") for ln in FLAGS.read_text().splitlines() if ln and not ln.startswith("#")]
        return {f: a for f, a in rows}
    p = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(p)
    return {s: "0" if a.nargs == 0 else "1" if a.nargs is None else str(a.nargs)
            for s, a in p._option_string_actions.items() if s.startswith("--")}


def check_flags(argv: list[str], flags: dict[str, str]) -> None:
    """Raise ValueError unless argv (a server's arguments, after `-m module`) is flags and their values only."""
    i = 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name not in flags:
            raise ValueError(f"{name!r} is not a flag of SGLang 0.5.23's server")
        arity = flags[name]
        if "=" in a or arity in ("0", "?", "*"):
            i += 1
            if arity == "*":
                while i < len(argv) and not argv[i].startswith("--"):
                    i += 1
            continue
        n = 1 if arity == "1" else None
        if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            raise ValueError(f"{name} takes a value")
        i += 2
        if n is None:  # "+": one or more
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1


def test_launched_servers_get_the_fronts_context_length(models, monkeypatch):  # noqa: F811
    """A launched server got no --context-length, so SGLang used the model's own (512 here) while tars admitted
    requests by inference.max_context: with 1024, prompt 20 + 998 new tokens passed the front and SGLang refused it.
    The launcher now passes --context-length max_context; sglang_args may set it only to the same value; a max_context
    past the model's context length is refused before anything starts, unless SGLang's own switch allows it."""
    from inference_server.sglang_launch import SGLangFleet, launch_sglang_servers

    def ctx(cfg):
        cmd = SGLangFleet(cfg, models["a"]).commands[0]  # not started: only its command line
        assert cmd.count("--context-length") + sum(a.startswith("--context-length=") for a in cmd) == 1, cmd
        return cmd[cmd.index("--context-length") + 1] if "--context-length" in cmd else cmd[-1].split("=", 1)[1]

    assert ctx(InferenceConfig(max_context=256, engine="sglang", sglang_launch=1)) == "256"
    assert ctx(InferenceConfig(max_context=256, engine="sglang", sglang_launch=1, sglang_args=["--context-length", "256"])) == "256"
    assert ctx(InferenceConfig(max_context=300, engine="sglang", sglang_launch=1, sglang_args=["--context-length=300"])) == "300"
    with pytest.raises(ValueError, match=r"sglang_args sets --context-length 300 but inference.max_context is 256"):
        SGLangFleet(InferenceConfig(max_context=256, engine="sglang", sglang_launch=1,
                                    sglang_args=["--context-length", "300"]), models["a"])
    # every form SGLang's argparse takes as --context-length (a prefix: allow_abbrev; SGLang keeps the last one) is
    # checked, in both launchers; these passed, and SGLang ran with a context of 300 behind a front admitting 256
    for args, written in ((["--context-len", "300"], "--context-len"), (["--context-l=300"], "--context-l"),
                          (["--context-length=300"], "--context-length"), (["--context", "300"], "--context"),
                          (["--context-length", "256", "--context-len", "300"], "--context-len")):
        with pytest.raises(ValueError, match=f"sglang_args sets {written} 300 but inference.max_context is 256"):
            SGLangFleet(InferenceConfig(max_context=256, engine="sglang", sglang_launch=1, sglang_args=args), models["a"])
        with pytest.raises(ValueError, match=f"sglang_args sets {written} 300 but inference.max_context is 256"):
            launch_sglang_servers(models["a"], 256, extra_args=args, module=CONFORMANCE, wait_s=1)
    cmd = SGLangFleet(InferenceConfig(max_context=256, engine="sglang", sglang_launch=1,
                                      sglang_args=["--context-len", "256"]), models["a"]).commands[0]
    assert "--context-length" not in cmd and cmd[-2:] == ["--context-len", "256"]  # agrees: passed as written, once
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    with pytest.raises(ValueError, match=r"inference.max_context=1024 is past the model's context length 512 .*"
                                         r"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"):
        SGLangFleet(InferenceConfig(max_context=1024, engine="sglang", sglang_launch=1), models["a"])
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    assert ctx(InferenceConfig(max_context=1024, engine="sglang", sglang_launch=1)) == "1024"
    # The k8s overlay's SGLang is started with the context length the shared config gives the front.
    pod = yaml.safe_load(OVERLAY.read_text())["spec"]["template"]["spec"]
    args = next(c for c in pod["containers"] if c["name"] == "sglang")["args"]
    conf = yaml.safe_load((ROOT / "deploy" / "k8s" / "base" / "config.yaml").read_text())
    assert args[args.index("--context-length") + 1] == str(conf["inference"]["max_context"])


def test_the_pinned_flag_list_is_sglang_0_5_23s():
    head = FLAGS.read_text().splitlines()[:5]
    assert any("sglang 0.5.23" in ln and "server_args.py" in ln for ln in head)
    flags = _sglang_flags()
    assert len(flags) > 400 and flags["--skip-tokenizer-init"] == "0" and flags["--weight-version"] == "1"


def test_launcher_and_k8s_overlay_flags_exist_in_sglang(models):  # noqa: F811
    flags = _sglang_flags()
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_launch=2, sglang_args=["--mem-fraction-static", "0.85", "--tp-size", "1"])
    from inference_server.sglang_launch import SGLangFleet

    fleet = SGLangFleet(cfg, models["a"], weight_version=3)  # not started: only its command lines
    for cmd in fleet.commands:
        assert cmd[1:3] == ["-m", "sglang.launch_server"]
        check_flags(cmd[3:], flags)
        for needed in ("--skip-tokenizer-init", "--weight-version", "--model-path", "--tokenizer-path", "--port"):
            assert needed in cmd
        assert cmd[cmd.index("--weight-version") + 1] == "3"
    assert [c[c.index("--port") + 1] for c in fleet.commands] == ["30000", "30001"]
    pod = yaml.safe_load(OVERLAY.read_text())["spec"]["template"]["spec"]
    sg = next(c for c in pod["containers"] if c["name"] == "sglang")
    assert sg["command"][-2:] == ["-m", "sglang.launch_server"] and sg["image"] == "lmsysorg/sglang:v0.5.23-cu130"
    check_flags(sg["args"], flags)
    launcher = {a for a in fleet.commands[0] if a.startswith("--")} - {"--mem-fraction-static", "--tp-size"}
    assert launcher <= set(sg["args"])  # the overlay passes what the launcher passes
    # A misspelt flag, or a flag without its value, is caught.
    for bad in (["--skip-tokenizer-int"], ["--weight-versions", "1"], ["--model-path"], ["--port", "--host", "x"]):
        with pytest.raises(ValueError):
            check_flags(bad, flags)



def test_one_sglang_version_everywhere():
    """The pyproject extra, the flag list and the overlay's image name the same SGLang release."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    assert extra == ["sglang==0.5.23"]
    assert FLAGS.name == "sglang_0.5.23_flags.tsv"
    pod = yaml.safe_load(OVERLAY.read_text())["spec"]["template"]["spec"]
    assert next(c for c in pod["containers"] if c["name"] == "sglang")["image"].startswith("lmsysorg/sglang:v0.5.23-")


def test_a_launched_server_dies_with_the_front(tmp_path):
    """PDEATHSIG through the launcher's exec trampoline: the front killed with SIGKILL takes its servers down."""
    script = tmp_path / "front.py"
    script.write_text(f"""import os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from inference_server.sglang_launch import _spawn
p = _spawn([sys.executable, "-c", "import time; time.sleep(120)"], None)
print(p.pid, flush=True)
time.sleep(120)
""")
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pid = int(front.stdout.readline())
    assert _state(pid) not in ("Z", None)
    t0 = time.monotonic()
    while b"time.sleep(120)" not in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():  # the trampoline has exec'd
        assert time.monotonic() - t0 < 10, "the trampoline never exec'd the server"
        time.sleep(0.01)
    front.kill()
    front.wait(10)
    t0 = time.monotonic()
    while _state(pid) not in ("Z", None):  # reaped by init, or a zombie of it
        assert time.monotonic() - t0 < 10, "the server outlived its front"
        time.sleep(0.05)


def _state(pid: int) -> str | None:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None
