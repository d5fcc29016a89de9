"""The `tars` command: up | eval | envd | serve | actor | learner | sft | data | merge | ctl | config | bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from tars.bench import BENCHES, run_bench  # the registry; each benchmark is imported when it runs


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="a preset from core/presets (e.g. quickstart)")
    p.add_argument("--config", help="a YAML config file (e.g. a run's config.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. learner.staleness.eta=4")


def _load(a):
    from core import config as C

    return C.load(a.preset, a.config, a.set)


def _split(s: str) -> list[str]:
    return [x for x in s.split(",") if x]



def _data_or_merge(a) -> int:
    try:
        if a.cmd == "data":
            from learner.data import split

            print(json.dumps(split(a.inputs, a.out, a.min_return)))
        else:
            from learner.merge import merge, parse_weights

            print(json.dumps(merge(a.ckpts, parse_weights(a.weights, len(a.ckpts)), a.out)))
    except (ValueError, FileNotFoundError) as e:
        print(f"tars {a.cmd}: {e}", file=sys.stderr)
        return 2
    return 0


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
    p.add_argument("--tokenizer", default="", help="tokenizer directory of the model (needed with --model host:port)")
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
    p.add_argument("--engine", choices=["local", "sglang"], help="override inference.engine (docs/sglang.md)")
    p.add_argument("--sglang-launch", type=int, metavar="N", help="engine sglang: start and supervise N SGLang servers "
                   "on --model (inference.sglang_launch)")
    p.add_argument("--sglang-url", action="append", metavar="URL", help="engine sglang: attach to this running SGLang "
                   "server (repeatable; inference.sglang_urls)")
    p.add_argument("--ready-file")

    p = sub.add_parser("actor", help="run an actor")
    _config_args(p)
    p.add_argument("--envd", required=True, help="envd addresses, comma-separated")
    p.add_argument("--inference", required=True, help="inference addresses, comma-separated")
    p.add_argument("--stream", required=True, help="learner stream address (tcp://host:port)")
    p.add_argument("--tokenizer", required=True, help="the model's tokenizer directory (its checkpoint directory)")
    p.add_argument("--actor-id", default="")
    p.add_argument("--spool-dir", help="keep unacknowledged trajectories on disk, re-sent after a restart")
    p.add_argument("--ready-file")

    p = sub.add_parser("learner", help="run the learner")
    _config_args(p)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--model", required=True, help="initial HF-layout model directory (version 0)")
    p.add_argument("--inference", default="", help="inference addresses to publish weights to, comma-separated")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue from run-dir/ckpt (or ckpt.old when the save "
                       "after it was interrupted); no checkpoint there is an error (exit 2)")
    start.add_argument("--resume-or-fresh", action="store_true", help="like --resume, but with no checkpoint at all "
                       "in run-dir start fresh at version 0 (a learner's first start under a supervisor)")
    p.add_argument("--ready-file")

    p = sub.add_parser("sft", help="supervised fine-tuning on stored trajectories and/or scripted demonstrations")
    _config_args(p)
    p.add_argument("--model", required=True, help="HF-layout model directory to start from")
    p.add_argument("--out", required=True, help="output model directory (HF layout)")
    p.add_argument("--data", nargs="*", default=[], help="trajectory files (e.g. a split's sft.twl, a run's trajectories.twl)")
    p.add_argument("--demos", type=int, default=0, help="also N scripted demonstrations (sft.demonstrator on actor.env_ids)")
    p.add_argument("--steps", type=int, help="updates (default sft.steps)")

    p = sub.add_parser("data", help="trajectory data: split stored trajectories into an SFT set and a CT set")
    p.add_argument("what", choices=["split"])
    p.add_argument("inputs", nargs="+", help="trajectory files (.twl: a run's trajectories.twl or stream.wal)")
    p.add_argument("--out", required=True, help="directory for sft.twl, ct.twl and split.json")
    p.add_argument("--min-return", type=float, help="also pass episodes with at least this return (default: success only)")

    p = sub.add_parser("merge", help="interpolate checkpoints: theta = sum_k alpha_k theta_k")
    p.add_argument("ckpts", nargs="+", help="HF-layout model directories, learner checkpoints or run directories")
    p.add_argument("--weights", required=True, help="alpha_k, comma-separated, >= 0, summing to 1")
    p.add_argument("--out", required=True, help="output model directory (HF layout)")

    p = sub.add_parser("ctl", help="talk to running processes (ControlService)",
                       description="tars ctl status | pause | resume | drain | undrain | checkpoint | set eta N | "
                                   "sessions [list | kill ID]. Without --run/--target: $TARS_RUN, ./run/, or the "
                                   "latest local `tars up` (~/.cache/tars/last-run).")
    p.add_argument("what", choices=["status", "pause", "resume", "drain", "undrain", "checkpoint", "set", "set-eta",
                                    "sessions", "kill-session"])
    p.add_argument("rest", nargs="*", help="eta N for set; N for set-eta; list | kill ID for sessions; ID for kill-session")
    p.add_argument("--run", help="run directory of a local `tars up` (finds every process)")
    p.add_argument("--target", action="append", default=[], help="host:port of a ControlService (repeatable)")
    p.add_argument("--token", default="", help="bearer token of the ControlServices (control.auth_token); default: "
                                                "control.auth_token from the run's config.yaml (a token given here "
                                                "is visible to other local users in ps: prefer --token-file)")
    p.add_argument("--token-file", default="", help="read the control token from this file (e.g. a systemd "
                                                     "credential or a Kubernetes Secret volume)")
    p.add_argument("--timeout", type=float, default=5.0, help="deadline of each call, seconds")
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
    from core.config import ConfigError

    try:
        if a.cmd == "ctl":
            from tars import ctl

            return ctl.main(a)
        if a.cmd == "bench":
            return run_bench(a.which, a.args)
        if a.cmd in ("data", "merge"):
            return _data_or_merge(a)
        cfg = _load(a)
    except ConfigError as e:
        print(f"tars: config error: {e}", file=sys.stderr)
        return 2
    from core.chat import TokenizerError
    from core.model import MissingWeights, UnsupportedModel, WeightsMismatch

    try:  # a checkpoint directory that cannot be used: one line naming what is wrong, not a traceback
        return _dispatch(a, cfg)
    except (UnsupportedModel, MissingWeights, WeightsMismatch, TokenizerError) as e:
        print(f"tars {a.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:  # e.g. an OTEL_* variable naming an exporter tars does not offer (telemetry.setup)
        print(f"tars: config error: {e}", file=sys.stderr)
        return 2


def _dispatch(a, cfg) -> int:
    if a.cmd == "up":
        from tars.up import up

        return up(cfg, a.out, quiet=a.quiet)
    if a.cmd == "eval":
        from tars.eval import main as eval_main

        return eval_main(a, cfg)
    if a.cmd in ROLES:
        from core import telemetry

        telemetry.setup(cfg.telemetry, ROLES[a.cmd], getattr(a, "run_dir", None))
        try:
            return _role(a, cfg)
        finally:
            telemetry.shutdown()  # flush the last spans before the process goes
    return _role(a, cfg)


ROLES = {"envd": "envd", "serve": "inference", "actor": "actor", "learner": "learner"}  # command -> service.name


def _role(a, cfg) -> int:
    if a.cmd == "envd":
        from envd.server import main as envd_main
        from core.proc import die_with_parent

        die_with_parent()
        if a.port is not None:
            cfg.envd.port = a.port
        return envd_main(cfg.envd, a.ready_file, control_token=cfg.control.auth_token)
    if a.cmd == "serve":
        from inference_server.server import main as serve_main
        from core.proc import die_with_parent

        die_with_parent()
        if a.port is not None:
            cfg.inference.port = a.port
        for key, value in (("engine", a.engine), ("sglang_launch", a.sglang_launch), ("sglang_urls", a.sglang_url)):
            if value is not None:
                setattr(cfg.inference, key, value)
        return serve_main(cfg.inference, a.model, a.version, a.ready_file, control_token=cfg.control.auth_token)
    if a.cmd == "actor":
        from actor.main import main as actor_main

        return actor_main(cfg, _split(a.envd), _split(a.inference), a.stream, a.tokenizer, a.actor_id, a.ready_file, a.spool_dir)
    if a.cmd == "learner":
        from learner.main import main as learner_main

        return learner_main(cfg, a.run_dir, a.model, _split(a.inference), a.ready_file,
                            resume=a.resume or a.resume_or_fresh, fresh_if_none=a.resume_or_fresh)
    if a.cmd == "sft":
        from learner.sft import run as sft_run

        try:
            from tars.demos import source

            demos = source(cfg, a.demos) if a.demos > 0 else None
            print(json.dumps(sft_run(cfg, a.model, a.out, a.data, demos, a.steps)))
        except (ValueError, FileNotFoundError) as e:
            print(f"tars sft: {e}", file=sys.stderr)
            return 2
        return 0
    if a.cmd == "config":
        from core import config as C

        print(C.help_text())
        print("\n# resolved:")
        print(json.dumps(C.to_dict(cfg), indent=2))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
