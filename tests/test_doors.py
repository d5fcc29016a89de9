"""Doors: bearer-token auth on every gRPC listener, CURVE on the trajectory stream, loopback binding by default, and
a lint that finds unbounded queues and blocking waits without a deadline in the source (with an explicit allowlist)."""
import ast
import asyncio
import json
import pathlib
import subprocess
import sys
import time

import grpc
import pytest
import zmq

from core import config as C
from core import rpc
from core.control import ControlServicer, add_control
from core.v1 import control_pb2, control_pb2_grpc, env_pb2, env_pb2_grpc, inference_pb2, inference_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKEN = "s3cret-token"


def _start(tmp, role, argv):
    ready = tmp / f"{role}.json"
    p = subprocess.Popen([sys.executable, "-m", "tars.cli", *argv, "--ready-file", str(ready)], cwd=ROOT,
                         stdout=open(tmp / f"{role}.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while not ready.exists():
        assert p.poll() is None and time.monotonic() < deadline, (tmp / f"{role}.log").read_text()[-2000:]
        time.sleep(0.05)
    return p, json.loads(ready.read_text())["address"]


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def test_every_grpc_listener_rejects_unauthenticated_calls(tmp_path):
    from tars.up import build_model

    cfg = C.load("quickstart", None, ["sft.steps=0", f"envd.auth_token={TOKEN}", f"inference.auth_token={TOKEN}",
                                      f"control.auth_token={TOKEN}"])
    C.save(cfg, tmp_path / "config.yaml")
    model, _ = build_model(cfg, tmp_path, lambda m: None)
    conf = ["--config", str(tmp_path / "config.yaml")]
    procs = []
    try:
        envd, envd_addr = _start(tmp_path, "envd", ["envd", *conf])
        procs.append(envd)
        inf, inf_addr = _start(tmp_path, "inference", ["serve", *conf, "--model", str(model)])
        procs.append(inf)
        assert envd_addr.startswith("127.0.0.1:") and inf_addr.startswith("127.0.0.1:")  # loopback by default
        calls = {
            envd_addr: [lambda ch: env_pb2_grpc.EnvServiceStub(ch).Ping(env_pb2.PingRequest(), timeout=10),
                        lambda ch: env_pb2_grpc.EnvServiceStub(ch).CreateSession(
                            env_pb2.CreateSessionRequest(env_id="builtin/menu"), timeout=10),
                        lambda ch: control_pb2_grpc.ControlServiceStub(ch).Status(control_pb2.StatusRequest(), timeout=10),
                        lambda ch: control_pb2_grpc.ControlServiceStub(ch).Command(
                            control_pb2.CommandRequest(name="drain"), timeout=10)],
            inf_addr: [lambda ch: inference_pb2_grpc.InferenceServiceStub(ch).GetVersion(inference_pb2.GetVersionRequest(), timeout=10),
                       lambda ch: inference_pb2_grpc.InferenceServiceStub(ch).Generate(inference_pb2.GenerateRequest(
                           input_ids=[1], sampling=inference_pb2.SamplingParams(max_new_tokens=1)), timeout=10),
                       lambda ch: control_pb2_grpc.ControlServiceStub(ch).Status(control_pb2.StatusRequest(), timeout=10)],
        }
        for addr, fns in calls.items():
            for token in ("", "wrong"):
                ch = rpc.sync_channel(addr, token)
                for fn in fns:
                    assert _code(lambda: fn(ch)) == grpc.StatusCode.UNAUTHENTICATED, (addr, token)
                ch.close()
            ch = rpc.sync_channel(addr, TOKEN)
            assert _code(lambda: fns[0](ch)) == grpc.StatusCode.OK
            ch.close()
        # envd was not drained by the rejected Command
        ch = rpc.sync_channel(envd_addr, TOKEN)
        assert _code(lambda: env_pb2_grpc.EnvServiceStub(ch).CreateSession(
            env_pb2.CreateSessionRequest(env_id="builtin/menu"), timeout=10)) == grpc.StatusCode.OK
        ch.close()
    finally:
        for p in procs:
            p.terminate()
            p.wait(20)


def test_actor_and_learner_control_servers_are_authenticated():
    # The actor's and the learner's ControlService are built exactly like this (actor/main.py, learner/control.py).
    for path in ("actor/main.py", "learner/control.py"):
        src = (ROOT / path).read_text()
        assert "rpc.make_server(auth_token=" in src and "127.0.0.1" in src, path

    async def go():
        server = rpc.make_server(auth_token=TOKEN)
        add_control(server, ControlServicer("actor", lambda: {"ok": 1}))
        port = rpc.bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            for token, want in (("", grpc.StatusCode.UNAUTHENTICATED), ("nope", grpc.StatusCode.UNAUTHENTICATED),
                                (TOKEN, grpc.StatusCode.OK)):
                ch = rpc.channel(f"127.0.0.1:{port}", token)
                try:
                    await control_pb2_grpc.ControlServiceStub(ch).Status(control_pb2.StatusRequest(), timeout=5)
                    got = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    got = e.code()
                await ch.close()
                assert got == want, token
        finally:
            await server.stop(0)

    asyncio.run(go())


def test_control_token_guards_the_control_service_beside_a_service_token(tmp_path):
    """envd and the inference server share their listener with their ControlService: control.auth_token guards the
    latter, the service token the rest; `tars ctl` takes the token from the run's config.yaml."""
    from envd.server import EnvServer
    from tars import ctl

    async def go():
        srv = EnvServer(C.EnvdConfig(auth_token=TOKEN), control_token="ctl-token")
        await srv.start()
        try:
            got = {}
            for token in ("", TOKEN, "ctl-token"):
                ch = rpc.channel(srv.address, token)
                for name, call in (("env", lambda: env_pb2_grpc.EnvServiceStub(ch).Ping(env_pb2.PingRequest(), timeout=5)),
                                   ("control", lambda: control_pb2_grpc.ControlServiceStub(ch).Status(
                                       control_pb2.StatusRequest(), timeout=5))):
                    try:
                        await call()
                        got[token, name] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as e:
                        got[token, name] = e.code()
                await ch.close()
            return got
        finally:
            await srv.stop(0)

    got = asyncio.run(go())
    U, OK = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK
    assert got == {("", "env"): U, ("", "control"): U, (TOKEN, "env"): OK, (TOKEN, "control"): U,
                   ("ctl-token", "env"): U, ("ctl-token", "control"): OK}
    cfg = C.load(None, None, [f"envd.auth_token={TOKEN}", "control.auth_token=ctl-token"])
    C.save(cfg, tmp_path / "config.yaml")
    assert ctl.run_control_token(str(tmp_path)) == "ctl-token" and ctl.run_control_token(str(tmp_path / "x")) == ""


def test_defaults_bind_loopback():
    cfg = C.RunConfig()
    assert cfg.envd.host == "127.0.0.1" and cfg.inference.host == "127.0.0.1"
    assert cfg.learner.stream.host == "127.0.0.1"


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE (libsodium)")
def test_curve_stream_rejects_clients_without_the_right_key(tmp_path):
    from core.stream.sender import TrajectorySender
    from test_stream import Consumer, receiver, traj, wait_until

    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    wrong_pub, _ = zmq.curve_keypair()
    rx = receiver(tmp_path, curve_secret_key=server_sec)
    addr = rx.start()
    con = Consumer(rx)
    con.start()

    async def attempt(tag, **keys) -> bool:
        tx = TrajectorySender(addr, f"actor-{tag}", heartbeat_s=0.05, dead_after_s=1.0, **keys)
        try:
            await tx.start(timeout=2.0)
            await tx.send(traj(f"t-{tag}"), timeout=2.0)
            await tx.flush(timeout=5.0)
            return True
        except TimeoutError:
            return False
        finally:
            await tx.close()

    try:
        assert not asyncio.run(attempt("plain"))  # no CURVE at all: the handshake never completes
        assert not asyncio.run(attempt("wrongkey", curve_server_key=wrong_pub, curve_public_key=client_pub,
                                       curve_secret_key=client_sec))
        assert asyncio.run(attempt("good", curve_server_key=server_pub, curve_public_key=client_pub,
                                   curve_secret_key=client_sec))
        assert wait_until(lambda: "t-good" in con.ids, 5)
        assert not {"t-plain", "t-wrongkey"} & set(con.ids)
        assert set(rx._actors) == {b"actor-good"}  # the others never got past the CURVE handshake
    finally:
        con.halt.set()
        con.join(5)
        rx.stop()


# ---- lint: every queue bounded, every blocking wait with a deadline ------------------------------------------------
SOURCES = ("core", "envd", "inference_server", "actor", "learner", "tars")
QUEUES = {"Queue", "LifoQueue", "PriorityQueue"}
WAITS = {"result", "wait", "get", "join", "recv", "recv_multipart", "recv_string", "recv_json", "acquire", "communicate"}
# "path: source line" -> why this one is fine. Keep it short; anything new needs a deadline or a reason here.
ALLOW = {
    "tars/eval.py: stopper = asyncio.create_task(stop.wait())": "a stop signal raced against work in asyncio.wait, not a wait",
    "actor/main.py: waiters = [*tasks, asyncio.ensure_future(stop.wait())]": "raced in asyncio.wait(timeout=...)",
    "actor/main.py: tr = task.result()": "in a done callback: the task is finished, result() does not block",
    "core/stream/durability.py: while self._req.get():  # close() sends False": "the WAL syncer thread's idle wait; close() sends it False",
    "tars/bench/stream.py: zmq socket without an explicit high-water mark": "benchmark's plain-socket baseline",
    "tars/bench/stream.py: a.recv()": "benchmark child process; the parent joins it with a deadline",
    "tars/bench/stream.py: conn.recv()  # wait for the parent's start signal so only the transfer is timed": "benchmark child",
    "inference_server/server.py: q: asyncio.Queue = asyncio.Queue()  # bounded by the request's max_new_tokens (+1 end marker)":
        "one request's tokens: bounded by its max_new_tokens",
    "inference_server/server.py: await stop.wait()": "the process's main wait for SIGTERM",
    "envd/server.py: await stop.wait()": "the process's main wait for SIGTERM",
    "inference_server/scripted.py: await stop.wait()": "the scripted engine process's main wait for SIGTERM",
    "tars/bench/inference_rollouts.py: await gate.wait()": "benchmark workers held while the server restarts; "
        "the benchmark's own run time bounds it",
    "inference_server/server.py: out = fut.result()": "after fut.exception() was checked: the future is done",
    "actor/main.py: hello.result()": "after hello.done() was checked: the task is done (raises its error)",
    "inference_server/image_prep.py: return task.result(), None": "after task.exception() was checked: the task is done",
    "inference_server/server.py: item = await asyncio.wait_for(q.get(), None if deadline is None else max(0.0, deadline - loop.time()))":
        "the call's own gRPC deadline; without one gRPC cancels the handler when the client goes away",
    "inference_server/sglang_behaviour.py: out = f.result()": "a conformance script over as_completed futures (done)",
    "envd/sessions.py: cf.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or _safe(orphan, f.result()))":
        "in a done callback: the future is finished",
    "tars/bench/front_client.py: await asyncio.wait_for(self.proc.wait(), 10)": "inside wait_for: a 10 s deadline",
    "tars/bench/front_client.py: await self.proc.wait()": "reaping the bench's client process after SIGKILL",
    'tars/bench/front_client.py: raise RuntimeError(f"the bench\'s client process ended (exit {await self.proc.wait()})")':
        "its stdout closed: the client process has exited, wait() only reaps it",
}


def lint() -> list[str]:
    found = []
    for root in SOURCES:
        for p in sorted((ROOT / root).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if rel.startswith("core/v1/"):
                continue  # generated protobuf code
            src = p.read_text()
            lines = src.splitlines()
            if ".socket(zmq." in src and "hwm" not in src:
                found.append(f"{rel}: zmq socket without an explicit high-water mark")
            for n in ast.walk(ast.parse(src)):
                if not isinstance(n, ast.Call):
                    continue
                f = n.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                kw = {k.arg for k in n.keywords}
                if any(k.arg == "blocking" and isinstance(k.value, ast.Constant) and k.value.value is False
                       for k in n.keywords):
                    kw.add("timeout")  # acquire(blocking=False): returns at once, no wait
                bad = (name in QUEUES and not n.args and "maxsize" not in kw) or name == "SimpleQueue" or (
                    isinstance(f, ast.Attribute) and name in WAITS and not n.args and not kw & {"timeout", "flags"})
                if bad:
                    found.append(f"{rel}: {lines[n.lineno - 1].strip()}")
    return found


def test_every_queue_is_bounded_and_every_wait_has_a_deadline():
    found = lint()
    new = [f for f in found if f not in ALLOW]
    assert not new, "unbounded queue or wait without a deadline (add a bound/timeout, or a reason to ALLOW):\n" + "\n".join(new)
    stale = [k for k in ALLOW if k not in found]
    assert not stale, f"allowlist entries that no longer match anything: {stale}"


def test_lint_catches_what_it_should(tmp_path, monkeypatch):
    bad = ROOT / "tars" / "_lint_probe_tmp.py"
    bad.write_text("import queue, threading\nq = queue.Queue()\nthreading.Event().wait()\n")
    try:
        found = lint()
    finally:
        bad.unlink()
    assert "tars/_lint_probe_tmp.py: q = queue.Queue()" in found
    assert "tars/_lint_probe_tmp.py: threading.Event().wait()" in found


@pytest.mark.slow  # a whole topology (~20-60 s); the in-process CURVE test above is in the default run
@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE (libsodium)")
def test_curve_on_by_option_in_a_real_run(tmp_path):
    """learner.stream.curve_* in the config: the actors of a real run talk CURVE and training proceeds, while a
    client without the learner's public key gets nowhere."""
    from tars.faults import FaultRun
    from core.stream.sender import TrajectorySender

    public, secret = zmq.curve_keypair()
    topo = FaultRun(tmp_path / "run")
    topo.cfg.learner.stream.curve_secret_key = secret.decode()  # keys go in the YAML (Z85 is not --set friendly)
    topo.cfg.learner.stream.curve_public_key = public.decode()
    with topo:
        topo.start()
        topo.wait_versions(2, 120)

        async def plain() -> bool:
            tx = TrajectorySender(topo.stream, "intruder", heartbeat_s=0.05)
            try:
                await tx.start(timeout=2.0)
                return True
            except TimeoutError:
                return False
            finally:
                await tx.close()

        assert not asyncio.run(plain())
        assert topo.status("learner")["stream"]["hellos"] >= 1
