"""envd's resource budgets, attacked through real daemons: the workspace quota's entry cap, the host-wide process,
memory and disk budget over real sandboxes, the per-client session cap, paged session listings, and coordinates that
are not on the screen (NaN, infinite, negative, past the edge)."""
from __future__ import annotations

import asyncio
import json
import math
import os
import pathlib
import shutil
import tempfile

import grpc
import pytest

from envd import scratch
from envd.sandbox import missing_tools
from envd_compliance import envd_client, expect_code, run
from core import rpc
from core.action import Action, ActionError
from core.v1 import common_pb2, control_pb2, control_pb2_grpc, env_pb2

needs_sandbox = pytest.mark.skipif(bool(missing_tools()), reason=f"sandbox tools missing: {missing_tools()}")
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


async def _terminal(c, options: dict[str, str], reset: bool = True, **kw) -> str:
    sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="terminal", options=options, **kw))).session_id
    if reset:
        r = await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=1), timeout=30)
        assert r.outcome == common_pb2.RUNNING, r.info_json
    return sid


async def _type(c, sid: str, line: str) -> env_pb2.StepResponse:
    return await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="type", content=line + "\n")),
                        timeout=90)


async def _budget(c) -> dict:
    st = await control_pb2_grpc.ControlServiceStub(c.channel).Status(control_pb2.StatusRequest(), timeout=5)
    return json.loads(st.metrics_json)["budget"]


# ---- the workspace quota ----------------------------------------------------------------------------------------

@pytest.fixture
def fast_tmp(monkeypatch, tmp_path):
    """Workspaces on tmpfs where there is one: 100,001 files take seconds there and can take minutes on a busy disk."""
    shm = pathlib.Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = pathlib.Path(tempfile.mkdtemp(prefix="tars-test-", dir=shm))
        d.chmod(0o711)   # a root daemon's sandbox runs as a uid of its own, which must pass through
        monkeypatch.setattr(tempfile, "tempdir", str(d))
        # This process's scratch root is made once, under the temp dir of its first use: made in here, it would
        # outlive d's removal, and every later terminal session of the process would fail (FileNotFoundError) --
        # as the rest of this file did when run on its own. One made here is forgotten with d.
        monkeypatch.setattr(scratch, "_root", None)
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


@needs_sandbox
def test_files_past_the_entry_cap_then_a_big_write_are_over_quota(fast_tmp):
    """The attack: 100,001 files in one directory stop the quota walk before it reaches a subdirectory, whose big
    file then goes uncounted. Reaching the entry cap is itself over quota now."""
    async def body():
        async with envd_client() as c:
            sid = await _terminal(c, {"disk_mb": "16", "fsize_mb": "64", "timeout_s": "60", "wait_s": "30",
                                      "screen_chars": "4000"})
            r = await _type(c, sid, "mkdir -p a/big && (cd a && seq 100001 | xargs touch) && ls a | wc -l")
            while r.outcome == common_pb2.RUNNING and "[running" in r.observation.text[-300:]:
                r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="wait")), timeout=90)
            if r.outcome == common_pb2.RUNNING:   # the quota let the files through: now the big write
                r = await _type(c, sid, "head -c 40000000 /dev/zero > a/big/blob; ls -l a/big")
            assert r.outcome == common_pb2.TRUNCATED, r.observation.text[-800:]
            assert "quota" in r.observation.text[-800:], r.observation.text[-800:]
    run(body(), timeout=240)


@needs_sandbox
def test_disk_files_option_bounds_the_workspace_entries():
    async def body():
        async with envd_client() as c:
            await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="terminal", options={"disk_files": "2000000"})))
            sid = await _terminal(c, {"disk_files": "50", "wait_s": "10"})
            r = await _type(c, sid, "touch f{1..40}")
            assert r.outcome == common_pb2.RUNNING, r.observation.text[-500:]
            r = await _type(c, sid, "touch g{1..40}")
            assert r.outcome == common_pb2.TRUNCATED and "more than 50 files" in r.observation.text, \
                r.observation.text[-500:]
    run(body(), timeout=120)


# ---- the host budget --------------------------------------------------------------------------------------------

@needs_sandbox
def test_sessions_past_the_host_budget_are_refused_until_one_ends():
    async def body():
        # Each sandbox below is allowed 40 processes and 100 + 8 + 8 MiB (memory_mb + /tmp + /dev/shm).
        small = {"nproc": "40", "memory_mb": "100", "tmp_mb": "8"}
        async with envd_client(max_total_pids=100, max_total_memory_mb=10_000, gc_interval_s=0.05) as c:
            a = await _terminal(c, small)
            b = await _terminal(c, small)
            bud = await _budget(c)
            assert (bud["pids"], bud["max_total_pids"], bud["memory_mb"], bud["max_total_memory_mb"]) == \
                (80, 100, 232, 10_000)
            e = await expect_code(RESOURCE_EXHAUSTED, _terminal(c, small, reset=False))
            assert "host budget" in e.details() and "80 processes" in e.details(), e.details()
            # A Reset asking for more processes than are left is refused too; the session keeps working.
            e = await expect_code(RESOURCE_EXHAUSTED, c.Reset(env_pb2.ResetRequest(
                session_id=a, seed=1, options={"nproc": "64"}), timeout=30))
            assert "host budget" in e.details()
            r = await _type(c, a, "echo still-here")
            assert "still-here\n[exit 0]" in r.observation.text
            # Closing one gives its share back: a new session fits (and runs).
            await c.Close(env_pb2.SessionRef(session_id=b))
            b2 = await _terminal(c, small)
            assert "ok-b2" in (await _type(c, b2, "echo ok-b2")).observation.text
            # So does an expired lease.
            await c.Close(env_pb2.SessionRef(session_id=b2))
            short = await _terminal(c, small, lease_ttl_s=2.0)
            await expect_code(RESOURCE_EXHAUSTED, _terminal(c, small, reset=False))
            await asyncio.sleep(3.0)
            await expect_code(grpc.StatusCode.NOT_FOUND, _type(c, short, "true"))
            await _terminal(c, small)
        async with envd_client(max_total_pids=10_000, max_total_memory_mb=300) as c:
            await _terminal(c, small)
            await _terminal(c, small)
            e = await expect_code(RESOURCE_EXHAUSTED, _terminal(c, small, reset=False))
            assert "232 MiB" in e.details() and "300 MiB" in e.details(), e.details()
            # Backends that run in the daemon itself take nothing of the budget.
            await c.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click"))
    run(body(), timeout=180)


def test_the_budget_defaults_come_from_the_host():
    from envd.budget import host_totals

    t = host_totals()
    with open("/proc/meminfo") as f:
        mem_mb = int(f.readline().split()[1]) >> 10
    assert 0 < t.memory_mb <= mem_mb and t.memory_mb >= mem_mb // 2
    assert 0 < t.pids <= int(open("/proc/sys/kernel/pid_max").read())
    assert host_totals(7, 9).pids == 7 and host_totals(7, 9).memory_mb == 9


@needs_sandbox
def test_sessions_past_the_disk_budget_are_refused_until_one_ends():
    """The budget bounded processes and memory only: 531 terminals of memory_mb=32, nproc=8, disk_mb=16384 fit this
    host's default budget, 8.3 TiB of workspace quotas on a disk with 74 GiB free. Each is charged its quota now."""
    async def body():
        # Each sandbox below may hold 16 MiB in its workspace plus one 8 MiB file the polled quota has not seen yet.
        small = {"nproc": "16", "memory_mb": "64", "tmp_mb": "4", "disk_mb": "16", "fsize_mb": "8"}
        async with envd_client(max_total_pids=10_000, max_total_memory_mb=10_000, max_total_disk_mb=50) as c:
            a = await _terminal(c, small)
            b = await _terminal(c, small)
            bud = await _budget(c)
            assert (bud["disk_mb"], bud["max_total_disk_mb"]) == (48, 50), bud
            e = await expect_code(RESOURCE_EXHAUSTED, _terminal(c, small, reset=False))
            assert "not enough disk (envd.max_total_disk_mb)" in e.details() and "48 MiB of disk" in e.details() \
                and "memory (" not in e.details(), e.details()
            # A Reset that raises the quota past the budget is refused; the session keeps its episode.
            e = await expect_code(RESOURCE_EXHAUSTED, c.Reset(env_pb2.ResetRequest(
                session_id=a, seed=1, options={"disk_mb": "20"}), timeout=30))
            assert "disk" in e.details(), e.details()
            assert "still-here" in (await _type(c, a, "echo still-here")).observation.text
            # Closing one gives its disk back: a new session fits.
            await c.Close(env_pb2.SessionRef(session_id=b))
            await until_budget(c, lambda bud: bud["disk_mb"] == 24)
            await _terminal(c, small)
            assert (await _budget(c))["disk_mb"] == 48
    run(body(), timeout=180)


async def until_budget(c, ok, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not ok(await _budget(c)):
        assert asyncio.get_running_loop().time() < deadline, await _budget(c)
        await asyncio.sleep(0.05)


def test_disk_claims_per_backend():
    """A sandbox claims its workspace quota plus one file of fsize_mb; a hybrid's one workspace under one quota is
    claimed once, not once for its terminal and once for its desktop."""
    from envd.base import Resources
    from envd.desktop_apps import DESKTOP_LIMITS
    from envd.hybrid import HybridEnv
    from envd.miniwob_backend import CHROMIUM_FLAGS, MiniWoBEnv
    from envd.sandbox_limits import Limits

    assert Limits.from_options({"disk_mb": "300", "fsize_mb": "20"}).host_claim().disk_mb == 320
    assert Limits().host_claim() == Resources(64, 512 + 64 + 16, 256 + 64)
    assert DESKTOP_LIMITS.host_claim().disk_mb == 320

    class Side:
        def __init__(self, r):
            self.r = r

        def resources(self, options=None):
            return self.r

    hybrid = type("H", (), {"terminal": Side(Resources(64, 592, 320)), "desktop": Side(Resources(64, 1075, 320))})()
    assert HybridEnv.resources(hybrid) == Resources(128, 1667, 320)
    assert MiniWoBEnv.claim.disk_mb == 64 and f"--disk-cache-size={32 << 20}" in CHROMIUM_FLAGS


def test_the_disk_budget_defaults_to_three_quarters_of_the_scratch_file_system(monkeypatch, tmp_path):
    from envd.budget import HostBudget, free_disk_mb, host_totals
    from envd.base import Resources

    st = os.statvfs(tempfile.gettempdir())
    free = st.f_bavail * st.f_frsize >> 20
    assert abs(free_disk_mb() - free) <= 64      # other writers on the host move it a little between the two reads
    assert abs(host_totals().disk_mb - free * 3 // 4) <= 64
    assert host_totals(max_total_disk_mb=5).disk_mb == 5
    # It follows the temp dir, where the scratch roots (every session's files) are made.
    monkeypatch.setattr(scratch, "base", lambda: tmp_path)
    asked = []
    monkeypatch.setattr(os, "statvfs", lambda p: asked.append(str(p)) or
                        type("S", (), {"f_bavail": 1000, "f_frsize": 1 << 20})())
    assert host_totals().disk_mb == 750 and asked == [str(tmp_path)]
    b = HostBudget(host_totals(10, 10))
    b.charge(Resources(1, 1, 700), "one")
    with pytest.raises(Exception, match=r"not enough disk \(envd.max_total_disk_mb\).*options disk_mb, fsize_mb"):
        b.charge(Resources(1, 1, 51), "two")
    b.release(Resources(1, 1, 700))
    b.charge(Resources(1, 1, 51), "two")


# ---- the per-client cap -----------------------------------------------------------------------------------------

def test_per_client_session_cap_whatever_client_id_is_sent():
    async def body():
        async with envd_client(max_sessions_per_client=3, max_sessions=100) as c:
            sids = [(await c.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click",
                                                                        client_id=f"actor-{i}"))).session_id
                    for i in range(3)]
            # A client that changes its declared client_id is still the same client.
            e = await expect_code(RESOURCE_EXHAUSTED, c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="builtin/click", client_id="someone-else")))
            assert "per-client session cap" in e.details() and "127.0.0.1" in e.details(), e.details()
            await c.Reset(env_pb2.ResetRequest(session_id=sids[0]))
            await expect_code(RESOURCE_EXHAUSTED, c.Fork(env_pb2.ForkRequest(session_id=sids[0])))
            await c.Close(env_pb2.SessionRef(session_id=sids[1]))
            await c.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click"))
            await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="builtin/click", client_id="x" * 257)))
    run(body())


# ---- paged listings ---------------------------------------------------------------------------------------------

def test_sessions_list_pages_and_ctl_fetches_every_page():
    from tars import ctl

    n = 1100

    async def body():
        async with envd_client(max_sessions=n, max_sessions_per_client=n) as c:
            ids = []
            for _ in range(0, n, 50):
                made = await asyncio.gather(*(c.CreateSession(env_pb2.CreateSessionRequest(
                    env_id="builtin/click", client_id="c" * 256)) for _ in range(50)))
                ids += [r.session_id for r in made]
            stub = control_pb2_grpc.ControlServiceStub(c.channel)

            async def page(**args):
                r = await stub.Command(control_pb2.CommandRequest(name="sessions_list",
                                                                  args={k: str(v) for k, v in args.items()}), timeout=10)
                return json.loads(r.result_json)

            first = await page()
            assert len(first["sessions"]) == 100 and first["total"] == n and first["next_offset"] == 100
            seen, offset = [], 0
            while offset is not None:
                p = await page(offset=offset, limit=500)
                assert len(p["sessions"]) <= 500
                seen += [s["id"] for s in p["sessions"]]
                offset = p["next_offset"]
            assert sorted(seen) == sorted(ids)
            for bad in ({"limit": 501}, {"limit": 0}, {"offset": -1}, {"limit": "many"}):
                await expect_code(grpc.StatusCode.INVALID_ARGUMENT, page(**bad))
            # `tars ctl sessions` pages through them (a sync client, as the CLI uses).
            ch = rpc.sync_channel(c.server.address)
            try:
                listed = await asyncio.to_thread(ctl._all_sessions, control_pb2_grpc.ControlServiceStub(ch), {}, 10)
            finally:
                ch.close()
            assert sorted(s["id"] for s in listed) == sorted(ids)
    run(body(), timeout=120)


# ---- coordinates ------------------------------------------------------------------------------------------------

BAD_POINTS = [[math.nan, 10], [10, math.nan], [math.inf, 10], [10, -math.inf], [-1, 10], [10, -0.5], [640, 10],
              [10, 400], [1e12, 1e12]]


def test_coordinates_off_the_screen_are_refused_and_the_session_survives():
    async def body():
        async with envd_client() as c:
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/click", seed=3))).session_id
            r = await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=3))
            assert (r.observation.width, r.observation.height) == (640, 400)
            for p in BAD_POINTS:
                for a in (env_pb2.Action(type="click", point=p), env_pb2.Action(type="scroll", point=p, direction="down"),
                          env_pb2.Action(type="drag", point=[5, 5], end_point=p)):
                    e = await expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                                          c.Step(env_pb2.StepRequest(session_id=sid, action=a)))
                    assert "point" in e.details(), e.details()
            # Nothing counted as a step; the session still plays.
            r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="click", point=[1, 1])))
            assert r.observation.step == 1 and r.outcome == common_pb2.RUNNING
    run(body())


def test_action_type_refuses_non_finite_points():
    for p in ([math.nan, 1], [1, math.inf], [-math.inf, 0]):
        with pytest.raises(ActionError, match="finite"):
            Action("click", point=p)
        with pytest.raises(ActionError, match="finite"):
            Action.from_dict({"type": "drag", "point": [1, 1], "end_point": p})
    with pytest.raises(ActionError, match="outside the 640x400 screen"):
        Action("click", point=(-3, 4)).check_on_screen(640, 400)
    Action("click", point=(639.5, 399.5)).check_on_screen(640, 400)
