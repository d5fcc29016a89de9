"""`tars ctl`: ControlService client for the processes of a run.

Targets, first match wins: --target host:port (repeatable) and/or --run DIR; else $TARS_RUN; else ./run/ when the
current directory is a run directory; else the run file of the latest local `tars up` ($XDG_CACHE_HOME/tars/last-run,
~/.cache/tars/last-run), the last fallback only, with a warning on stderr naming the run it picked. Every call has a deadline (--timeout); a target that is down is reported as such, and a
run file whose process has exited is reported without waiting for a deadline. Every ControlService checks
control.auth_token when one is set (`tars up` makes one per run): --token-file (or --token, which other local users
can read in `ps`), else the control.auth_token of the run's config.yaml (--run, or the run found as above).

    tars ctl status                      role, version, throughput, queue depths, staleness, sessions
    tars ctl pause | resume              actors stop / restart admitting episodes
    tars ctl drain | undrain             envd finishes running sessions, accepts no new ones (undrain: accept again)
    tars ctl set eta N | set-eta N       learner staleness bound, live
    tars ctl checkpoint                  learner checkpoints after the current update
    tars ctl sessions [list]             envd sessions (fetched a page at a time)
    tars ctl sessions kill ID | kill-session ID
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import grpc
import yaml

from core import rpc
from core.proc import pid_alive
from core.v1 import control_pb2, control_pb2_grpc

COMMANDS = {"pause": ("actor", "pause"), "resume": ("actor", "resume"), "drain": ("envd", "drain"),
            "undrain": ("envd", "undrain"), "checkpoint": ("learner", "checkpoint"), "set-eta": ("learner", "set_eta"),
            "sessions": ("envd", "sessions_list"), "kill-session": ("envd", "sessions_kill")}
WHAT = ["status", "pause", "resume", "drain", "undrain", "checkpoint", "set", "set-eta", "sessions", "kill-session"]


class CtlError(Exception):
    """A usage or discovery problem: printed as one line, exit status 2."""


# ---- finding the run ---------------------------------------------------------------------------------------------
def last_run_file() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "tars" / "last-run"


def remember_run(out_dir: pathlib.Path) -> None:
    """Called by `tars up`: the run file `tars ctl` falls back to (best effort: a read-only home is no error)."""
    p = last_run_file()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"run_dir": str(out_dir), "pid": os.getpid(), "started": time.time()}))
        os.replace(tmp, p)
    except OSError:
        pass


def targets_of_run(run_dir: str) -> list[dict]:
    """[{role, address, pid}] from a run directory's run/*.json ready files."""
    run = pathlib.Path(run_dir) / "run"
    if not run.is_dir():
        raise CtlError(f"{run} not found: is {run_dir} the --out of a `tars up`?")
    out = []
    for f in sorted(run.glob("*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # being written (ready files are replaced atomically, but be lenient)
        if not isinstance(d, dict) or not isinstance(d.get("address"), str):
            continue  # not a ready file (a report.json of a run whose --out was named "run")
        out.append({"role": d.get("role", f.stem), "address": d["address"], "pid": d.get("pid"), "file": f.name})
    if not out:
        raise CtlError(f"{run} lists no processes: the run has not started any yet")
    return out


def run_control_token(run_dir: str) -> str:
    """control.auth_token of the config.yaml `tars up` saved in run_dir (or the file its control.auth_token_file
    names); "" when there is none. The file is the owner's only (0600): another user's run cannot be controlled."""
    try:
        d = yaml.safe_load((pathlib.Path(run_dir) / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return ""
    control = d.get("control") if isinstance(d, dict) else None
    if not isinstance(control, dict):
        return ""
    if not control.get("auth_token") and control.get("auth_token_file"):
        return token_from_file(str(control["auth_token_file"]))
    return str(control.get("auth_token") or "")


def token_from_file(path: str) -> str:
    from core.auth import SecretFileError, read_secret

    try:
        return read_secret(path, "control token file")
    except SecretFileError as e:
        raise CtlError(str(e)) from None


LAST_RUN_HOW = "the latest local `tars up`"


def find_run() -> tuple[str, str]:
    """(run directory, how it was found) when no --run/--target is given: $TARS_RUN, else the current directory's
    run, else (the last fallback) the run file of the latest local `tars up`; `how` starts with LAST_RUN_HOW then,
    and main() warns on stderr, since that run may be someone else's idea of "the" run."""
    if os.environ.get("TARS_RUN"):
        return os.environ["TARS_RUN"], "$TARS_RUN"
    if (pathlib.Path.cwd() / "run").is_dir() and any((pathlib.Path.cwd() / "run").glob("*.json")) and \
            not (pathlib.Path.cwd() / "run" / "report.json").is_file():  # ./run a run's own --out is not a run's run/
        return str(pathlib.Path.cwd()), "the current directory"
    p = last_run_file()
    if p.is_file():
        try:
            return json.loads(p.read_text())["run_dir"], f"{LAST_RUN_HOW}, {p}"
        except (OSError, ValueError, KeyError):
            raise CtlError(f"{p} is unreadable; give --run DIR or --target host:port") from None
    raise CtlError("no run found: no --run/--target, no $TARS_RUN, no ./run/, no "
                   f"{p} (written by `tars up`); give --run DIR or --target host:port")


def _pid_alive(pid) -> bool:
    return True if not pid else pid_alive(int(pid))  # no pid known: let the RPC decide


# ---- the command -------------------------------------------------------------------------------------------------
def parse_command(what: str, rest: list[str]) -> tuple[str, dict[str, str]]:
    """(key in COMMANDS or "status", args) from the words after `tars ctl`."""
    if what == "set":
        if len(rest) != 2 or rest[0] != "eta":
            raise CtlError("usage: tars ctl set eta N")
        what, rest = "set-eta", rest[1:]
    if what == "set-eta":
        if len(rest) != 1:
            raise CtlError("usage: tars ctl set-eta N")
        try:
            eta = int(rest[0])
        except ValueError:
            raise CtlError(f"eta must be an integer >= 0, got {rest[0]!r}") from None
        if eta < 0:
            raise CtlError(f"eta must be an integer >= 0, got {eta}")
        return what, {"eta": str(eta)}
    if what == "sessions":
        if not rest or rest == ["list"]:
            return "sessions", {}
        if rest[0] == "kill" and len(rest) == 2:
            return "kill-session", {"id": rest[1]}
        raise CtlError("usage: tars ctl sessions [list | kill ID]")
    if what == "kill-session":
        if len(rest) != 1:
            raise CtlError("usage: tars ctl kill-session ID")
        return what, {"id": rest[0]}
    if rest:
        raise CtlError(f"tars ctl {what} takes no arguments (got {' '.join(rest)})")
    return what, {}


def _call(t: dict, what: str, args: dict, token: str, timeout: float) -> dict | None:
    """One target: Status (always: it says the role), then the command if the target has that role."""
    addr = t["address"]
    r = {"target": addr, "role": t.get("role", "?")}
    name = t.get("file", "").removesuffix(".json")
    if name and not name.startswith(r["role"]):  # the run's name for it: "judge" is an inference server too
        r["name"] = name
    if not _pid_alive(t.get("pid")):
        return {**r, "error": f"DOWN: process {t['pid']} ({t.get('file', addr)}) is not running; has the run ended?"}
    ch = rpc.sync_channel(addr, token)
    try:
        stub = control_pb2_grpc.ControlServiceStub(ch)
        st = stub.Status(control_pb2.StatusRequest(), timeout=timeout)
        r["role"] = st.role
        if what == "status":
            return {**r, "version": st.policy_version, "pid": st.pid, "run_id": st.run_id, "uptime_s": round(st.uptime_s, 1),
                    "metrics": json.loads(st.metrics_json or "{}")}
        want_role, name = COMMANDS[what]
        if st.role != want_role:
            return None
        if what == "sessions":
            return {**r, "ok": True, "message": "ok", "result": _all_sessions(stub, args, timeout)}
        c = stub.Command(control_pb2.CommandRequest(name=name, args=args), timeout=timeout)
        return {**r, "ok": c.ok, "message": c.message, "result": json.loads(c.result_json or "null")}
    except grpc.RpcError as e:
        code = e.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            msg = f"DOWN: cannot reach {addr} ({e.details()})"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            msg = f"no answer from {addr} within {timeout:g} s (deadline); is it overloaded or hung?"
        else:
            msg = f"{code.name}: {e.details()}"
        return {**r, "error": msg}
    finally:
        ch.close()


def _all_sessions(stub, args: dict, timeout: float, page: int = 500) -> list:
    """Every session of an envd, fetched a page at a time (one reply for thousands would pass the message limit)."""
    out: list = []
    offset = 0
    for _ in range(1_000_000 // page):  # a bound on pages: far beyond any envd.max_sessions
        c = stub.Command(control_pb2.CommandRequest(name="sessions_list", args={**args, "offset": str(offset),
                                                                                "limit": str(page)}), timeout=timeout)
        res = json.loads(c.result_json or "null")
        if isinstance(res, list):  # an envd from before paging answers everything at once
            return res
        out += res["sessions"]
        if res.get("next_offset") is None or res["next_offset"] <= offset:
            return out
        offset = res["next_offset"]
    return out


def summary(role: str, m: dict) -> str:
    """The figures that matter for a role, in one line."""
    def g(d, *ks, default=None):
        for k in ks:
            d = d.get(k, default) if isinstance(d, dict) else default
        return d

    def num(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    if role == "actor":
        return (f"episodes={m.get('episodes', 0)} episodes/s={num(m.get('episodes_per_s'))} running={m.get('running')} "
                f"paused={m.get('paused')} outbox={g(m, 'sender', 'pending')} success={num(m.get('success_recent'), '{:.3f}')} "
                f"infra_errors={m.get('infra_error', 0)}")
    if role == "envd":
        return (f"sessions={m.get('sessions')}/{m.get('max_sessions')} draining={m.get('draining')} steps={m.get('steps')} "
                f"step_ms p50={num(m.get('step_ms_p50'), '{:.2f}')} p99={num(m.get('step_ms_p99'), '{:.2f}')} "
                f"infra_errors={m.get('infra_errors')} by_env={m.get('sessions_by_env')} "
                f"budget pids={g(m, 'budget', 'pids')}/{g(m, 'budget', 'max_total_pids')} "
                f"memory_mb={g(m, 'budget', 'memory_mb')}/{g(m, 'budget', 'max_total_memory_mb')} "
                f"disk_mb={g(m, 'budget', 'disk_mb')}/{g(m, 'budget', 'max_total_disk_mb')} "
                f"memory_cgroups={str(m.get('memory_cgroups') or '-').split(' ')[0].rstrip(':')}")
    if role == "inference":
        return (f"tokens/s={num(m.get('tokens_per_s'))} waiting={m.get('waiting')} running={m.get('running')} "
                f"idle_share={num(m.get('idle_share'), '{:.2f}')} cache_hit={num(m.get('cache_hit_share'), '{:.2f}')} "
                f"weight_updates={m.get('weight_updates')}")
    if role == "learner":
        h = m.get("staleness_histogram") or {}
        c = m.get("counters") or {}
        return (f"eta={g(m, 'staleness', 'eta')} queue={m.get('queue')} received={c.get('received', 0)} "
                f"trained={c.get('trained', 0)} too_stale={c.get('too_stale', 0)} "
                f"staleness mean={num(h.get('mean'), '{:.2f}')} max={h.get('max')} "
                f"step_s={num(g(m, 'last', 'step_s'), '{:.2f}')}")
    return json.dumps(m)[:300]


def _settle_kill(results: list[dict], sid: str) -> int:
    """kill-session goes to every envd, and a session lives in one: the others' "unknown session" is no failure
    once one closed it (exit 0); exit 1, with one line saying so, when none had it."""
    closed = [r["target"] for r in results if r.get("ok") is True]
    unknown = [r for r in results if r.get("ok") is False and str(r.get("message", "")).startswith("unknown session")]
    if closed:
        for r in unknown:
            r.update(ok=True, message=f"not here (closed on {closed[0]})")
        return 0
    if unknown and len(unknown) == len(results):
        results.append({"target": "-", "role": "envd",
                        "error": f"no envd has session {sid!r} ({len(unknown)} asked): already closed, or a wrong id?"})
    return 1


def main(a) -> int:
    try:
        what, args = parse_command(a.what, list(a.rest or ()))
        targets = [{"role": "?", "address": t} for t in a.target]
        run_dir = a.run
        if a.run:
            targets += targets_of_run(a.run)
        if not targets:
            run_dir, how = find_run()
            if how.startswith(LAST_RUN_HOW):
                print(f"tars ctl: warning: no --run, $TARS_RUN or ./run/ here: using {run_dir} ({how}); choose "
                      "another with --run DIR or TARS_RUN=DIR", file=sys.stderr, flush=True)
            targets = targets_of_run(run_dir)
            if not a.json:
                print(f"# run {run_dir} (from {how})")
    except CtlError as e:
        print(f"tars ctl: {e}", file=sys.stderr)
        return 2
    try:  # control.auth_token
        token = (a.token or (token_from_file(a.token_file) if getattr(a, "token_file", "") else "")
                 or (run_control_token(run_dir) if run_dir else ""))
    except CtlError as e:
        print(f"tars ctl: {e}", file=sys.stderr)
        return 2
    results = [r for r in (_call(t, what, args, token, a.timeout) for t in targets) if r is not None]
    rc = 1 if any("error" in r or r.get("ok") is False for r in results) else 0  # unreachable, or refused
    if what != "status" and not any("error" not in r for r in results):
        want = COMMANDS[what][0]
        results.append({"target": "-", "role": want, "error": f"no reachable {want} among the targets for {what!r}"})
        rc = 1
    if what == "kill-session":
        rc = _settle_kill(results, args["id"])
    if a.json:
        print(json.dumps(results, indent=2, default=str))
        return rc
    for r in results:
        role = f"{r['role']} ({r['name']})" if "name" in r else r["role"]
        head = f"{role:10s} {r['target']:22s}"
        if "error" in r:
            print(f"{head} ERROR {r['error']}")
        elif "metrics" in r:
            print(f"{head} v{r['version']} pid {r['pid']} up {r['uptime_s']}s {summary(r['role'], r['metrics'])}")
        elif what == "sessions" and isinstance(r["result"], list):
            print(f"{head} {len(r['result'])} session(s)")
            for s in r["result"]:
                print("    " + " ".join(f"{k}={v}" for k, v in s.items()))
        else:
            print(f"{head} {'ok' if r['ok'] else 'FAILED'} {r['message']} {json.dumps(r['result'], default=str)}")
    return rc
