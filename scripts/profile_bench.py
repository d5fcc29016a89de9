"""The workloads behind scripts/profile_bench.sh (run that script; this one only makes the load).

    python scripts/profile_bench.py WORKLOAD SECONDS PIDFILE

Each warms up, then writes the pid of the process to profile to PIDFILE and keeps its load going for SECONDS, so
that py-spy attaches to a process already in its steady state (imports, model set-up and browser start-up left out):
  stream-wal, stream-checkpoint  tars.bench.stream's stream run over and over (2000 trajectories of 32 KiB, as
                 `tars bench learner`): the receiver (the learner's side) runs in this process, whose pid is written;
                 the actor runs in a spawned child each run, as in the benchmark
  grpc-front     tars.bench.inference's front load: one LocalEngine (the bench's tiny model) behind an InferenceServer
                 in this process (its pid is written), rounds of 64 concurrent Generate calls of 64 tokens from
                 tars.bench.front_client in its own process
  envd-miniwob   a real `tars envd` daemon (its pid is written) stepping miniwob/click-checkboxes, clicking the first
                 checkbox as tars.bench.envd's figure does, from a sync client in this process
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def announce(pidfile: str, pid: int) -> None:
    tmp = pidfile + ".tmp"
    pathlib.Path(tmp).write_text(str(pid))
    os.replace(tmp, pidfile)


def stream(durability: str, seconds: float, pidfile: str) -> None:
    from tars.bench.stream import _run_stream, _trajs

    n, payload = 2000, 32 << 10
    trajs = _trajs(n, payload)
    with tempfile.TemporaryDirectory() as tmp:
        _run_stream(trajs, tmp, True, 512, 4096, True, payload, durability)  # warm-up
        announce(pidfile, os.getpid())
        t_end, rates = time.monotonic() + seconds, []
        while time.monotonic() < t_end:
            rates.append(n / _run_stream(trajs, tmp, True, 512, 4096, True, payload, durability)[0])  # (seconds, CPU...)
    print(f"stream {durability}: {len(rates)} runs, {min(rates):.0f}-{max(rates):.0f} trajectories/s", flush=True)


def grpc_front(seconds: float, pidfile: str) -> None:
    from core.config import InferenceConfig
    from core.model import CausalLM, DecoderConfig
    from inference_server.engine import LocalEngine
    from inference_server.server import InferenceServer
    from tars.bench.front_client import ClientProcess
    from tars.bench.inference import _prompts

    dc = DecoderConfig(vocab_size=300)
    cfg = InferenceConfig(threads=1, max_context=1024)
    eng = LocalEngine(cfg, CausalLM(dc).init_weights(0, std=0.1))

    async def run() -> list[float]:
        srv = InferenceServer(cfg, eng)
        await srv.start()
        try:
            async with ClientProcess(srv.address) as client:
                await client.rate(_prompts(64, 32, dc.vocab_size, 0), 8)
                announce(pidfile, os.getpid())
                t_end, rates, r = time.monotonic() + seconds, [], 1
                while time.monotonic() < t_end:
                    rates.append(await client.rate(_prompts(64, 32, dc.vocab_size, r), 64))
                    r += 1
                return rates
        finally:
            await srv.stop(1.0)

    try:
        rates = asyncio.run(run())
    finally:
        eng.close()
    print(f"grpc front: {len(rates)} rounds, {min(rates):.0f}-{max(rates):.0f} tokens/s", flush=True)


def envd_miniwob(seconds: float, pidfile: str) -> None:
    from core import rpc
    from core.v1 import env_pb2, env_pb2_grpc
    from tars.bench import envd as b

    with b.Daemon() as d, contextlib.ExitStack() as stack:
        stub = env_pb2_grpc.EnvServiceStub(stack.enter_context(rpc.sync_channel(d.address)))
        sid = stub.CreateSession(env_pb2.CreateSessionRequest(env_id="miniwob/click-checkboxes",
                                                              options=b.MINIWOB_OPTIONS), timeout=b.DEADLINE_S).session_id
        b._check(stub.Reset(env_pb2.ResetRequest(session_id=sid, seed=0, options=b.MINIWOB_OPTIONS),
                            timeout=b.DEADLINE_S))
        req = env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="click", target=f"[{b.MINIWOB_REF}]"))
        for _ in range(5):
            b._check(stub.Step(req, timeout=b.DEADLINE_S))
        announce(pidfile, d.proc.pid)
        t_end, ms = time.monotonic() + seconds, []
        while time.monotonic() < t_end:
            t0 = time.perf_counter()
            b._check(stub.Step(req, timeout=b.DEADLINE_S))
            ms.append((time.perf_counter() - t0) * 1e3)
        print(f"envd miniwob: {len(ms)} steps, p50 {b._pct(ms, 50):.1f} ms", flush=True)


WORKLOADS = {"stream-wal": lambda s, p: stream("wal", s, p), "stream-checkpoint": lambda s, p: stream("checkpoint", s, p),
             "grpc-front": grpc_front, "envd-miniwob": envd_miniwob}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in WORKLOADS:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        seconds = float(argv[1])
    except ValueError:
        print(f"SECONDS must be a number, got {argv[1]!r}", file=sys.stderr)
        return 2
    WORKLOADS[argv[0]](seconds, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
