"""The `tars` command: up | eval | envd | serve | actor | learner | ctl | config | bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="a preset from tars/presets (e.g. quickstart)")
    p.add_argument("--config", help="a YAML config file (e.g. a run's config.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. learner.eta=4")


def _load(a):
    from tars import config as C

    return C.load(a.preset, a.config, a.set)


def _split(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def _bench_inference(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tars bench inference", description="tokens/s of the engine direct vs through gRPC")
    ap.add_argument("--json", metavar="FILE", help="write the figures here as JSON")
    ap.add_argument("--quick", action="store_true", help="16 requests of 32 tokens, 2 rounds (combined runs, tests)")
    a = ap.parse_args(argv)
    from inference_server.bench import run

    kw = {"concurrency": 16, "max_new_tokens": 32, "rounds": 2} if a.quick else {}
    print(json.dumps(run(a.json, **kw), indent=2))
    return 0


def _bench_env(argv: list[str]) -> int:
    from envd.bench import main as bench_main

    return bench_main(argv)


def _bench_async(argv: list[str]) -> int:
    from tars.bench_async import main as bench_main

    return bench_main(argv)


def _bench_all(argv: list[str]) -> int:
    from tars.bench_all import main as bench_main

    return bench_main(argv)


# `tars bench NAME ARGS...`: each benchmark parses its own arguments (`tars bench NAME --help`), so building the
# top-level parser imports none of them. `tars bench all` runs every entry here (looked up when it runs).
BENCHES = {"env": _bench_env, "inference": _bench_inference}
BENCHES.update({"async": _bench_async, "all": _bench_all})


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tars", description="Asynchronous actor-learner RL for GUI agents")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("up", help="train: start envd, inference, learner and actors, and report")
    _config_args(p)
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--quiet", action="store_true")

    p = sub.add_parser("eval", help="evaluate a checkpoint, an inference server or a baseline on a suite")
    _config_args(p)
    p.add_argument("--suite", help="a shipped suite (builtin, miniwob, miniwob-oracle) or a suite YAML file")
    p.add_argument("--model", help="checkpoint directory (HF layout), inference host:port, random or oracle")
    p.add_argument("--out", help="results directory (resumed if it holds episodes of the same suite and model)")
    p.add_argument("--episodes", type=int, help="episodes per task (overrides the suite)")
    p.add_argument("--tasks", help="only these tasks (names or env ids), comma-separated")
    p.add_argument("--concurrency", type=int, default=8, help="episodes run at once")
    p.add_argument("--tokenizer", default="", help="tars_tokenizer.json (needed with --model host:port)")
    p.add_argument("--envd", default="", help="use this envd (host:port) instead of starting one")
    p.add_argument("--retry-infra", action="store_true", help="on resume, run infra-error episodes again")
    p.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"), help="compare two result directories")

    p = sub.add_parser("envd", help="run the environment daemon")
    _config_args(p)
    p.add_argument("--port", type=int, help="override envd.port")
    p.add_argument("--ready-file")

    p = sub.add_parser("serve", help="run the inference server")
    _config_args(p)
    p.add_argument("--model", required=True, help="HF-layout model directory")
    p.add_argument("--version", type=int, default=0, help="policy version of these weights")
    p.add_argument("--port", type=int, help="override inference.port")
    p.add_argument("--ready-file")

    p = sub.add_parser("actor", help="run an actor")
    _config_args(p)
    p.add_argument("--envd", required=True, help="envd addresses, comma-separated")
    p.add_argument("--inference", required=True, help="inference addresses, comma-separated")
    p.add_argument("--stream", required=True, help="learner stream address (tcp://host:port)")
    p.add_argument("--tokenizer", required=True, help="tars_tokenizer.json")
    p.add_argument("--actor-id", default="")
    p.add_argument("--spool-dir", help="keep unacknowledged trajectories on disk, re-sent after a restart")
    p.add_argument("--ready-file")

    p = sub.add_parser("learner", help="run the learner")
    _config_args(p)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--model", required=True, help="initial HF-layout model directory (version 0)")
    p.add_argument("--inference", default="", help="inference addresses to publish weights to, comma-separated")
    p.add_argument("--resume", action="store_true", help="continue from run-dir/ckpt")
    p.add_argument("--ready-file")

    p = sub.add_parser("ctl", help="talk to running processes (ControlService)")
    p.add_argument("what", choices=["status", "pause", "resume", "drain", "undrain", "checkpoint", "set-eta", "sessions", "kill-session"])
    p.add_argument("value", nargs="?", help="eta for set-eta, session id for kill-session")
    p.add_argument("--run", help="run directory of a local `tars up` (finds every process)")
    p.add_argument("--target", action="append", default=[], help="host:port of a ControlService")
    p.add_argument("--token", default="", help="bearer token")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("config", help="print every config field with its help")
    _config_args(p)

    p = sub.add_parser("bench", help="benchmarks: figures against baselines and goals, as a table and JSON",
                       description="tars bench NAME [--help | ARGS]: " + ", ".join(BENCHES))
    p.add_argument("which", choices=sorted(BENCHES), metavar="NAME", help=" | ".join(sorted(BENCHES)))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments (see tars bench NAME --help)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from tars.config import ConfigError

    try:
        if a.cmd == "ctl":
            from tars import ctl

            return ctl.main(a)
        if a.cmd == "bench":
            return BENCHES[a.which](a.args)
        cfg = _load(a)
    except ConfigError as e:
        print(f"tars: config error: {e}", file=sys.stderr)
        return 2
    if a.cmd == "up":
        from tars.up import up

        return up(cfg, a.out, quiet=a.quiet)
    if a.cmd == "eval":
        from tars.eval import main as eval_main

        return eval_main(a, cfg)
    if a.cmd == "envd":
        from envd.server import main as envd_main
        from tars.proc import die_with_parent

        die_with_parent()
        if a.port is not None:
            cfg.envd.port = a.port
        return envd_main(cfg.envd, a.ready_file)
    if a.cmd == "serve":
        from inference_server.server import main as serve_main
        from tars.proc import die_with_parent

        die_with_parent()
        if a.port is not None:
            cfg.inference.port = a.port
        return serve_main(cfg.inference, a.model, a.version, a.ready_file)
    if a.cmd == "actor":
        from actor.main import main as actor_main

        return actor_main(cfg, _split(a.envd), _split(a.inference), a.stream, a.tokenizer, a.actor_id, a.ready_file, a.spool_dir)
    if a.cmd == "learner":
        from learner.main import main as learner_main

        return learner_main(cfg, a.run_dir, a.model, _split(a.inference), a.ready_file, a.resume)
    if a.cmd == "config":
        from tars import config as C

        print(C.help_text())
        print("\n# resolved:")
        print(json.dumps(C.to_dict(cfg), indent=2))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
