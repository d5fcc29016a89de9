"""Throughput of the trajectory stream vs a raw DEALER->ROUTER msgpack link, same payloads, same process, same run.

All paths do the same useful work: encode each Trajectory on the actor, decode + validate it on the learner, hand it
to a consumer thread through a bounded queue. The stream adds credits, acks and the outbox, and for durability either
the WAL (append + batched fdatasync; "wal") or held notices and acks after each commit ("checkpoint", the consumer
committing every 1024 trajectories as a learner checkpointing every 16 updates of 64 would).
Besides the rates it reports the CPU each side spends per trajectory (cpu_us_{learner,actor}_{wal,checkpoint,raw},
median of the repeats: user + system time of the whole process, all threads, from the start signal), a figure that
swings much less than the rates when other work shares the machine.
The WAL writer process's CPU is reported apart (cpu_us_writer_wal); --wal-thread adds the in-process syncer thread
as a fourth path in the same rounds (ratio_wal_thread, cpu_us_learner_wal_thread); --raw-burst adds a raw link that
hands over through the stream's own one-wake-per-burst queue (ratio_vs_raw_burst, ratio_checkpoint_vs_raw_burst).
Run: `python -m tars.bench.stream [n] [payload_bytes] [repeats] [--wal-thread] [--raw-burst]`.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import queue
import resource
import statistics
import tempfile
import threading
import time

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from core.schema import Trajectory, Turn
from core.stream.ioloop import HandOver
from core.stream.wal import WriteAheadLog


def _trajs(n: int, payload_bytes: int) -> list[Trajectory]:
    T = max(8, payload_bytes // 13)  # 4 + 4 + 4 + 1 bytes per token
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, T).astype(np.int32)
    lp = -rng.random(T, dtype=np.float32)
    return [Trajectory(id=f"b{i}", env_id="bench", outcome="terminated", tokens=tokens, logprobs=lp,
                       versions=np.zeros(T, np.int32), mask=np.ones(T, np.uint8),
                       turns=[Turn("text:1", "x", {}, 1.0, 0, T)], ret=1.0) for i in range(n)]


def _consume(get, n: int, done: threading.Event, on_item=None, on_done=None) -> None:
    got = 0
    while got < n:
        tr = get(1.0)
        if tr is not None:
            got += 1
            if on_item:
                on_item(tr)
    done.set()
    if on_done:
        on_done()


async def _stream_actor(addr: str, trajs, credits: int, go=None) -> None:
    from core.stream.sender import TrajectorySender
    s = TrajectorySender(addr, "bench", window=credits)
    await s.start()
    if go is not None:
        go()
    for tr in trajs:
        await s.send(tr, timeout=60)
    await s.flush(timeout=60)
    await s.close()


async def _raw_actor(addr: str, trajs, go=None) -> None:
    ctx = zmq.asyncio.Context()
    d = ctx.socket(zmq.DEALER)
    d.linger = -1  # deliver everything before close returns
    d.connect(addr)
    if go is not None:
        go()
    for i, tr in enumerate(trajs):
        await d.send_multipart([b"T", msgpack.packb({"seq": i, "id": tr.id}), tr.encode()], copy=False)
    d.close()
    ctx.term()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _child(kind: str, addr: str, n: int, payload_bytes: int, credits: int, conn, cpu_out) -> None:
    trajs = _trajs(n, payload_bytes)
    t0 = [0.0]

    def go():
        conn.send("ready")
        conn.recv()  # wait for the parent's start signal so only the transfer is timed
        t0[0] = _cpu()

    coro = _stream_actor(addr, trajs, credits, go) if kind == "stream" else _raw_actor(addr, trajs, go)
    asyncio.run(coro)
    cpu_out.value = _cpu() - t0[0]  # the actor's CPU (user + system, all threads) from the start signal to its close


def _drive(kind: str, addr: str, trajs, credits: int, done: threading.Event, subprocess: bool,
           payload_bytes: int) -> tuple[float, float, float]:
    """Time from start signal until the consumer has all n: actor in this process (asyncio) or in a child process.
    Returns (seconds, learner-process CPU seconds until then, actor CPU seconds; NaN in one process)."""
    if not subprocess:
        c0 = _cpu()
        async def main() -> float:
            t = [0.0]
            coro = (_stream_actor(addr, trajs, credits, lambda: t.__setitem__(0, time.perf_counter()))
                    if kind == "stream" else _raw_actor(addr, trajs, lambda: t.__setitem__(0, time.perf_counter())))
            await coro
            await asyncio.to_thread(done.wait, 60)
            return time.perf_counter() - t[0]
        dt = asyncio.run(main())
        return dt, _cpu() - c0, float("nan")
    mp = multiprocessing.get_context("spawn")
    a, b = mp.Pipe()
    cpu_out = mp.Value("d", float("nan"))
    p = mp.Process(target=_child, args=(kind, addr, len(trajs), payload_bytes, credits, b, cpu_out), daemon=True)
    p.start()
    if not a.poll(60):
        raise TimeoutError("bench actor did not start")
    a.recv()
    c0 = _cpu()
    t0 = time.perf_counter()
    a.send("go")
    if not done.wait(60):
        raise TimeoutError("bench consumer did not get everything")
    dt = time.perf_counter() - t0
    learner_cpu = _cpu() - c0
    p.join(30)
    return dt, learner_cpu, cpu_out.value


def _proc_cpu(pid: int | None) -> float:
    """User + system CPU seconds of another process (the WAL writer), from /proc; 0 without one."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _run_stream(trajs, tmp: str, fsync: bool, credits: int, queue_size: int, subprocess: bool,
                payload_bytes: int, durability: str = "wal", commit_every: int = 1024,
                wal_writer: str = "process") -> tuple[float, float, float, float]:
    """durability="checkpoint": the consumer commits what it consumed every commit_every trajectories (a learner
    that checkpoints every 16 updates of 64) and at the end, which is when the actor's flush returns.
    Returns _drive's figures and the WAL writer process's CPU seconds over the transfer (0 without one)."""
    from learner.staleness import StalenessManager
    from core.stream.receiver import TrajectoryReceiver

    stal = StalenessManager(batch_size=64, eta=10**9)
    rx = TrajectoryReceiver("tcp://127.0.0.1:0", os.path.join(tmp, f"wal-{time.monotonic_ns()}"), stal,
                            credits=credits, queue_size=queue_size, fsync=fsync, durability=durability,
                            wal_writer=wal_writer)
    addr = rx.start()
    writer = getattr(getattr(rx.durability, "wal", None), "writer_pid", None)
    done = threading.Event()
    consumed: list[str] = []

    def on_item(tr):
        stal.on_accepted(1)
        if durability == "checkpoint":
            consumed.append(tr.id)
            if len(consumed) >= commit_every:
                rx.mark_consumed(consumed)
                rx.commit(consumed)
                consumed.clear()

    def on_done():
        rx.mark_consumed(consumed)
        rx.commit(consumed)

    con = threading.Thread(target=_consume, args=(rx.get, len(trajs), done, on_item, on_done), name="bench-consumer",
                           daemon=True)
    con.start()
    try:
        w0 = _proc_cpu(writer)
        out = _drive("stream", addr, trajs, credits, done, subprocess, payload_bytes)
        return (*out, _proc_cpu(writer) - w0)
    finally:
        rx.stop()


def _run_raw(trajs, queue_size: int, subprocess: bool, payload_bytes: int,
             burst: bool = False) -> tuple[float, float, float]:
    """burst=True: the consumer gets its trajectories through the stream's own hand-over (core.stream.ioloop.HandOver,
    one wake-up per burst of receives) instead of a queue.Queue that wakes it at every put."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    q: queue.Queue = queue.Queue(maxsize=queue_size)
    hand = HandOver(queue_size) if burst else None
    stop = threading.Event()

    def put(tr) -> None:
        if hand is None:
            q.put(tr, timeout=60)  # blocking put: the raw link has no flow control
            return
        end = time.monotonic() + 60
        while hand.full():  # the same bound: wait for the consumer, as the blocking put does
            hand.wake()
            if time.monotonic() > end:
                raise TimeoutError("raw link consumer stalled")
            stop.wait(0.0005)
        hand.put(tr)

    def rx_loop():
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(5):
                while True:
                    try:
                        _, _, hdr, payload = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msgpack.unpackb(hdr)
                    put(Trajectory.decode(payload))
                if hand is not None:
                    hand.wake()

    def get(timeout):
        if hand is not None:
            return hand.get(timeout)
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            return None

    th = threading.Thread(target=rx_loop, name="raw-receiver", daemon=True)
    th.start()
    done = threading.Event()
    con = threading.Thread(target=_consume, args=(get, len(trajs), done), name="bench-consumer", daemon=True)
    con.start()
    try:
        return (*_drive("raw", f"tcp://127.0.0.1:{port}", trajs, 0, done, subprocess, payload_bytes), 0.0)
    finally:
        stop.set()
        th.join(2)
        router.close(0)
        ctx.term()


def _breakdown(trajs, tmp: str) -> dict:
    """Per-trajectory cost of the pieces, measured alone (microseconds)."""
    k = min(len(trajs), 500)
    t0 = time.perf_counter()
    frames = [tr.encode() for tr in trajs[:k]]
    t1 = time.perf_counter()
    for fr in frames:
        Trajectory.decode(fr)
    t2 = time.perf_counter()
    wal = WriteAheadLog(os.path.join(tmp, "breakdown.wal")).open()
    for tr, fr in zip(trajs[:k], frames):
        wal.append(tr.id, fr)
    t3 = time.perf_counter()
    for _ in range(20):
        wal.append(f"x{_}", frames[0])
        wal.sync()
    t4 = time.perf_counter()
    wal.close()
    return {"encode_us": (t1 - t0) / k * 1e6, "decode_validate_us": (t2 - t1) / k * 1e6,
            "wal_append_us": (t3 - t2) / k * 1e6, "fdatasync_us": (t4 - t3) / 20 * 1e6}


def bench(n: int = 2000, payload_bytes: int = 32 << 10, repeats: int = 3, fsync: bool = True,
          credits: int = 512, queue_size: int = 4096, subprocess: bool = True, tmp_dir: str | None = None,
          wal_thread: bool = False, raw_burst_too: bool = False) -> dict:
    """Trajectories/s through TrajectorySender -> TrajectoryReceiver and through a raw link; best of `repeats`.

    subprocess=True runs the actor side in a child process, as in deployment (actor and learner never share a GIL);
    subprocess=False runs everything in this process, where both links compete for one GIL.
    wal_thread=True also runs the WAL with the in-process syncer thread (learner.stream.wal_writer=thread) in the
    same rounds: ratio_wal_thread against ratio (the writer process, the default).
    raw_burst_too=True also runs the raw link with the stream's one-wake-per-burst hand-over, a stricter baseline:
    ratio_vs_raw_burst, ratio_checkpoint_vs_raw_burst.
    """
    trajs = _trajs(n, payload_bytes)
    with tempfile.TemporaryDirectory(dir=tmp_dir) as tmp:
        stream, ckpt, raw, thread, raw_burst = [], [], [], [], []
        for _ in range(repeats):  # interleaved, so drift in machine load hits all alike
            raw.append(_run_raw(trajs, queue_size, subprocess, payload_bytes))
            if raw_burst_too:
                raw_burst.append(_run_raw(trajs, queue_size, subprocess, payload_bytes, burst=True))
            stream.append(_run_stream(trajs, tmp, fsync, credits, queue_size, subprocess, payload_bytes))
            ckpt.append(_run_stream(trajs, tmp, fsync, credits, queue_size, subprocess, payload_bytes, "checkpoint"))
            if wal_thread:
                thread.append(_run_stream(trajs, tmp, fsync, credits, queue_size, subprocess, payload_bytes,
                                          wal_writer="thread"))
        parts = _breakdown(trajs, tmp)
    s_rate, c_rate, r_rate = (n / min(r[0] for r in runs) for runs in (stream, ckpt, raw))

    def cpu_us(runs, i):  # median CPU microseconds per trajectory
        return round(statistics.median(r[i] for r in runs) / n * 1e6, 1)

    paths = (("wal", stream), ("checkpoint", ckpt), ("raw", raw)) + ((("wal_thread", thread),) if thread else ())
    cpu = {f"cpu_us_{side}_{path}": cpu_us(runs, i) for path, runs in paths
           for side, i in (("learner", 1), ("actor", 2))}
    cpu["cpu_us_writer_wal"] = cpu_us(stream, 3)  # the WAL writer process (not in cpu_us_learner_wal)
    extra = {}
    if thread:
        t_rate = n / min(r[0] for r in thread)
        extra = {"stream_wal_thread_per_s": round(t_rate, 1), "ratio_wal_thread": round(t_rate / r_rate, 3)}
    if raw_burst:
        b_rate = n / min(r[0] for r in raw_burst)
        extra |= {"raw_burst_per_s": round(b_rate, 1), "ratio_vs_raw_burst": round(s_rate / b_rate, 3),
                  "ratio_checkpoint_vs_raw_burst": round(c_rate / b_rate, 3)}
    return {"n": n, "payload_bytes": len(trajs[0].encode()), "fsync": fsync, "subprocess": subprocess,
            "stream_per_s": round(s_rate, 1), "raw_per_s": round(r_rate, 1), "ratio": round(s_rate / r_rate, 3),
            "stream_checkpoint_per_s": round(c_rate, 1), "ratio_checkpoint": round(c_rate / r_rate, 3), **extra,
            "stream_MB_s": round(s_rate * payload_bytes / 1e6, 1), "raw_MB_s": round(r_rate * payload_bytes / 1e6, 1),
            **cpu, **{k: round(v, 1) for k, v in parts.items()}}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tars.bench.stream", description=__doc__.split("\n")[0])
    ap.add_argument("n", type=int, nargs="?", help="trajectories per transfer")
    ap.add_argument("payload_bytes", type=int, nargs="?", help="bytes of each trajectory")
    ap.add_argument("repeats", type=int, nargs="?", help="transfers per path (best rate, median CPU)")
    ap.add_argument("--wal-thread", action="store_true", help="also the in-process WAL syncer thread, as a fourth path")
    ap.add_argument("--raw-burst", action="store_true",
                    help="also a raw link handing over through the stream's one-wake-per-burst queue (a stricter baseline)")
    a = ap.parse_args()
    pos = [x for x in (a.n, a.payload_bytes, a.repeats) if x is not None]
    print(json.dumps(bench(*pos, wal_thread=a.wal_thread, raw_burst_too=a.raw_burst), indent=1))
