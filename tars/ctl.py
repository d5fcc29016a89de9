"""`tars ctl`: ControlService client. Finds the processes of a local run from its run/ directory."""
from __future__ import annotations

import json
import pathlib

import grpc

from tars import rpc
from tars.v1 import control_pb2, control_pb2_grpc

COMMANDS = {"pause": ("actor", "pause"), "resume": ("actor", "resume"), "drain": ("envd", "drain"),
            "undrain": ("envd", "undrain"), "checkpoint": ("learner", "checkpoint"), "set-eta": ("learner", "set_eta"),
            "sessions": ("envd", "sessions_list"), "kill-session": ("envd", "sessions_kill")}


def targets_of_run(run_dir: str) -> list[tuple[str, str]]:
    run = pathlib.Path(run_dir) / "run"
    if not run.is_dir():
        raise FileNotFoundError(f"{run} not found: is {run_dir} the --out of a `tars up`?")
    out = []
    for f in sorted(run.glob("*.json")):
        d = json.loads(f.read_text())
        out.append((d.get("role", f.stem), d["address"]))
    return out


def main(a) -> int:
    targets = [("?", t) for t in a.target]
    if a.run:
        targets += targets_of_run(a.run)
    if not targets:
        print("tars ctl: give --run DIR or --target host:port")
        return 2
    results, rc = [], 0
    for role, addr in targets:
        stub = control_pb2_grpc.ControlServiceStub(rpc.sync_channel(addr, a.token))
        try:
            st = stub.Status(control_pb2.StatusRequest(), timeout=a.timeout)
            role = st.role
            if a.what == "status":
                results.append({"target": addr, "role": st.role, "version": st.policy_version, "pid": st.pid,
                                "uptime_s": round(st.uptime_s, 1), "metrics": json.loads(st.metrics_json or "{}")})
                continue
            want_role, name = COMMANDS[a.what]
            if role != want_role:
                continue
            args = {}
            if a.what == "set-eta":
                args["eta"] = str(int(a.value))
            if a.what == "kill-session":
                args["id"] = a.value or ""
            r = stub.Command(control_pb2.CommandRequest(name=name, args=args), timeout=a.timeout)
            results.append({"target": addr, "role": role, "ok": r.ok, "message": r.message, "result": json.loads(r.result_json or "null")})
        except grpc.RpcError as e:
            rc = 1
            results.append({"target": addr, "role": role, "error": f"{e.code().name}: {e.details()}"})
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            if "error" in r:
                print(f"{r['role']:10s} {r['target']:22s} ERROR {r['error']}")
            elif "metrics" in r:
                m = json.dumps(r["metrics"])
                print(f"{r['role']:10s} {r['target']:22s} v{r['version']} pid {r['pid']} up {r['uptime_s']}s {m[:300]}")
            else:
                print(f"{r['role']:10s} {r['target']:22s} {'ok' if r['ok'] else 'FAILED'} {r['message']} {json.dumps(r['result'])}")
    return rc
