"""The `tars` command: up | eval | envd | serve | actor | learner | sft | data | merge | ctl | config | bench."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import sys

from core.config import EXIT_USER, ConfigError, UserError
from core.proc import run_as_init
from tars.bench import BENCHES, run_bench  # the registry; each benchmark is imported when it runs


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="a preset from core/presets (e.g. quickstart)")
    p.add_argument("--config", help="a YAML config file (e.g. a run's config.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. learner.staleness.eta=4")


def _load(a):
    """The command's config: preset, --config, --set, then the command's own options that set a config field
    (--port, serve's --engine, ...), applied as `--set`s so the same checks hold them (a port past 65535 is refused,
    not wrapped)."""
    from core import config as C

    return C.load(a.preset, a.config, [*a.set, *_option_sets(a)])


def _option_sets(a) -> list[str]:
    section = {"envd": "envd", "serve": "inference"}.get(a.cmd)
    if section is None:
        return []
    opts = {"port": a.port}
    if a.cmd == "serve":
        opts.update(engine=a.engine, sglang_launch=a.sglang_launch,
                    sglang_urls=json.dumps(a.sglang_url) if a.sglang_url is not None else None)
    return [f"{section}.{k}={v}" for k, v in opts.items() if v is not None]


def _split(s: str) -> list[str]:
    return [x for x in s.split(",") if x]



def _data_or_merge(a) -> int:
    from tars import checks

    checks.out_dir(a.out)  # a file there, or a parent that is one: one line before any input is read (UserError)
    if a.cmd == "data" and a.min_return is not None and not math.isfinite(a.min_return):
        raise UserError(f"--min-return {a.min_return}: must be a finite number")
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
    p.add_argument("--suite", help="a shipped suite (builtin, miniwob, miniwob-oracle, games) or a suite YAML file")
    p.add_argument("--model", help="checkpoint directory (HF layout), inference host:port, random, oracle or noisy:P")
    p.add_argument("--out", help="results directory (resumed if it holds episodes of the same suite and model)")
    p.add_argument("--episodes", type=int, help="episodes per task (overrides the suite)")
    p.add_argument("--tasks", help="only these tasks (names or env ids), comma-separated")
    p.add_argument("--concurrency", type=_count(1), default=8, help="episodes run at once")
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

    p = sub.add_parser("learner-stop", help="stop a learner gracefully (a single `tars learner` or an `accelerate "
                       "launch` job: SIGTERM to its ranks) and wait until it has exited")
    p.add_argument("pid", type=int, help="the learner's process, or its launcher's (systemd: $MAINPID)")
    p.add_argument("--timeout", type=_seconds, default=280.0, help="seconds to wait for it to exit (default 280); "
                   "past it, exit 1 and leave the rest to the service manager")

    p = sub.add_parser("sft", help="supervised fine-tuning on stored trajectories and/or scripted demonstrations")
    _config_args(p)
    p.add_argument("--model", required=True, help="HF-layout model directory to start from")
    p.add_argument("--out", required=True, help="output model directory (HF layout)")
    p.add_argument("--data", nargs="*", default=[], help="trajectory files (e.g. a split's sft.twl, a run's trajectories.twl)")
    p.add_argument("--demos", type=_count(0), default=0, help="also N scripted demonstrations (sft.demonstrator on actor.env_ids)")
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
    p.add_argument("what", nargs="?", default="status", help="default: status",
                   choices=["status", "pause", "resume", "drain", "undrain", "checkpoint", "set", "set-eta", "sessions",
                            "kill-session"])
    p.add_argument("rest", nargs="*", help="eta N for set; N for set-eta; list | kill ID for sessions; ID for kill-session")
    p.add_argument("--run", help="run directory of a local `tars up` (finds every process)")
    p.add_argument("--target", action="append", default=[], help="host:port of a ControlService (repeatable)")
    p.add_argument("--token", default="", help="bearer token of the ControlServices (control.auth_token); default: "
                                                "control.auth_token from the run's config.yaml (a token given here "
                                                "is visible to other local users in ps: prefer --token-file)")
    p.add_argument("--token-file", default="", help="read the control token from this file (e.g. a systemd "
                                                     "credential or a Kubernetes Secret volume)")
    p.add_argument("--timeout", type=_seconds, default=5.0, help="deadline of each call, seconds (> 0)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("config", help="print every config field with its help")
    _config_args(p)

    p = sub.add_parser("bench", help="benchmarks: figures against baselines and goals, as a table and JSON",
                       description="tars bench NAME [--help | ARGS]: " + ", ".join(BENCHES))
    p.add_argument("which", choices=sorted(BENCHES), metavar="NAME", help=" | ".join(sorted(BENCHES)))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments (see tars bench NAME --help)")
    return ap


# Exit statuses of every command (README "Exit status"): 0 done; 1 a failure during the run (one line on stderr;
# TARS_TRACEBACK=1 shows the traceback); 2 a user error, found before any work (a path, a config value, a task id,
# the device), one line on stderr; 130 interrupted (Ctrl-C / SIGINT), one line on stderr, files left whole.
EXIT_FAILED, EXIT_INTERRUPTED = 1, 130  # EXIT_USER = 2: core.config


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean "the user asked for something that cannot be done": core.config.UserError
    (ConfigError among them) and the older specific ones, each already a clear message."""
    from core.chat import TokenizerError
    from core.model import MissingWeights, UnsupportedModel, WeightsMismatch
    from tars.evalsuite import SuiteError

    return UserError, TokenizerError, UnsupportedModel, MissingWeights, WeightsMismatch, SuiteError


def _one_line(e: BaseException) -> str:
    return " ".join(x.strip() for x in str(e).splitlines() if x.strip()) or type(e).__name__


def _count(lo: int):
    """An argparse type: an integer >= lo (`--concurrency 0` ran one episode at a time, `--demos -5` none, silently)."""
    def count(v: str) -> int:
        n = int(v)  # ValueError: argparse's "invalid count value"
        if n < lo:
            raise argparse.ArgumentTypeError(f"{v!r}: an integer >= {lo}")
        return n
    return count


def _seconds(v: str) -> float:
    """A finite number of seconds > 0 (argparse: anything else is a usage error, exit 2)."""
    import math

    x = float(v)  # ValueError: argparse's "invalid _seconds value"
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{v!r}: a number of seconds > 0")
    return x


def main(argv: list[str] | None = None) -> int:
    """The `tars` command; as a container's pid 1, under a minimal init that reaps orphans (core/proc.py
    run_as_init)."""
    return run_as_init(lambda: _cli(argv))


def _cli(argv: list[str] | None) -> int:
    """Every user error ends as one line on stderr and exit status 2, Ctrl-C as one line and 130, and a failure
    of an operator command as one line and 1 (the roles, run by `tars up` into logs/, keep their tracebacks)."""
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return _main(a)
    except KeyboardInterrupt as e:
        print(f"tars {a.cmd}: interrupted" + (f": {_one_line(e)}" if str(e) else ""), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - sorted below; anything not recognised keeps its traceback on request
        if isinstance(e, user_errors()):
            # a config error says so; the model errors name their kind (UnsupportedModel, TokenizerError, ...)
            kind = ("config error: " if isinstance(e, ConfigError) else "" if isinstance(e, UserError)
                    else f"{type(e).__name__}: ")
            print(f"tars {a.cmd}: {kind}{_one_line(e)}", file=sys.stderr, flush=True)
            return EXIT_USER
        if a.cmd in ROLES or os.environ.get("TARS_TRACEBACK"):
            raise
        print(f"tars {a.cmd}: failed: {type(e).__name__}: {_one_line(e)} (TARS_TRACEBACK=1 shows where)",
              file=sys.stderr, flush=True)
        return EXIT_FAILED


def _main(a) -> int:
    if a.cmd == "ctl":
        from tars import ctl

        return ctl.main(a)
    if a.cmd == "learner-stop":
        from tars import stop

        return stop.main(a.pid, a.timeout)
    if a.cmd == "bench":
        return run_bench(a.which, a.args)
    if a.cmd in ("data", "merge"):
        return _data_or_merge(a)
    cfg = _load(a)
    preflight(a, cfg)
    return _dispatch(a, cfg)


def preflight(a, cfg) -> None:
    """What each command needs, checked before it does any work (tars.checks; a UserError each)."""
    from tars import checks

    if a.cmd == "up":
        checks.device(cfg)
        checks.inference_device(cfg)
        checks.out_dir(a.out)
        if cfg.model.path:
            checks.model_dir(cfg.model.path, "model.path", template_kwargs=cfg.actor.chat_template_kwargs)
        checks.env_ids(cfg.actor.env_ids)
        checks.env_options(cfg.actor.env_ids, cfg.actor.env_options)
        checks.screenshots(cfg.actor, cfg.model.path)
        checks.judge(cfg.actor, starts_server=True)
        checks.env_hosts(cfg.actor.env_ids)         # tars up runs envd on this host
        if cfg.telemetry.enabled and cfg.telemetry.prometheus_port > 0:
            from tars.topology import Plan, served_judge

            judge = served_judge(cfg, cfg.actors)
            plan = Plan(pathlib.Path(a.out), pathlib.Path(a.out) / "config.yaml", None, n_actors=cfg.actors,
                        metrics_port=cfg.telemetry.prometheus_port,  # what tars.up plans: one envd, every role
                        judge=pathlib.Path(judge) if judge else None)
            checks.metrics_ports(cfg, plan.metrics_ports())
        if cfg.sft.steps > 0:
            _demos_possible(cfg, "actor.env_ids (the SFT warm start, sft.steps > 0)")
    elif a.cmd == "sft":
        checks.device(cfg)
        # demonstrations are tokenized with the model's
        checks.model_dir(a.model, need_tokenizer=a.demos > 0, template_kwargs=cfg.actor.chat_template_kwargs)
        checks.out_dir(a.out)
        missing = [d for d in a.data if not pathlib.Path(d).is_file()]
        if missing:
            raise UserError(f"--data {missing[0]}: no such file (trajectory files: a run's trajectories.twl, "
                            "a split's sft.twl)")
        if not a.data and a.demos <= 0:
            raise UserError("nothing to train on: give trajectory files (--data) and/or --demos N")
        if a.steps is not None and a.steps < 1:
            raise UserError(f"--steps {a.steps}: must be >= 1")
        if a.demos > 0:
            _demos_possible(cfg, "actor.env_ids (the tasks of --demos)")
            checks.env_hosts(cfg.actor.env_ids, "actor.env_ids (the tasks of --demos, rolled here)")
            checks.env_options(cfg.actor.env_ids, cfg.actor.env_options)
    elif a.cmd == "eval" and not a.compare:
        if a.out:
            checks.out_dir(a.out)
        if a.model and pathlib.Path(a.model).is_dir():
            checks.weights(a.model, f"--model {a.model}")
            checks.screenshots(cfg.actor, a.model)
        if a.tokenizer:
            checks.tokenizer_dir(a.tokenizer, template_kwargs=cfg.actor.chat_template_kwargs)
        if cfg.actor.judge_inference:  # asked as the actors ask it (without servers, tars eval does not judge)
            checks.judge(cfg.actor, starts_server=False)
    elif a.cmd == "learner":
        checks.device(cfg)
        checks.model_dir(a.model, need_tokenizer=False)
        checks.out_dir(a.run_dir, "--run-dir")
    elif a.cmd == "serve":
        checks.inference_device(cfg)
        checks.model_dir(a.model, need_tokenizer=False)
    elif a.cmd == "actor":
        # env ids and options are envd's to judge: a remote one may serve more
        checks.tokenizer_dir(a.tokenizer, template_kwargs=cfg.actor.chat_template_kwargs)
        checks.judge(cfg.actor, starts_server=False)


def _demos_possible(cfg, what: str) -> None:
    from tars import checks
    from tars.demos import parse_demonstrator

    try:
        parse_demonstrator(cfg.sft.demonstrator)
    except ValueError as e:
        raise ConfigError(f"sft.demonstrator: {e}") from None
    checks.demo_env_ids(cfg.actor.env_ids, what, cfg.sft.demonstrator)


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
        return envd_main(cfg.envd, a.ready_file, control_token=cfg.control.auth_token)
    if a.cmd == "serve":
        from inference_server.server import main as serve_main
        from core.proc import die_with_parent

        die_with_parent()
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
        from tars.demos import source, val_source

        demos = source(cfg, a.demos) if a.demos > 0 else None
        try:
            print(json.dumps(sft_run(cfg, a.model, a.out, a.data, demos, a.steps, val_demos=val_source(cfg))))
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"nothing written to {a.out} (it is written whole at the end)") from None
        except (ValueError, FileNotFoundError) as e:  # e.g. trajectory files that hold no usable trajectory
            if isinstance(e, user_errors()):
                raise
            raise UserError(str(e)) from None
        return 0
    if a.cmd == "config":
        from core import config as C

        print(C.help_text())
        print("\n# resolved (secrets shown as <set>):")
        print(json.dumps(_masked(C.to_dict(cfg)), indent=2))
        return 0
    return 2


_SECRETS = ("auth_token", "curve_secret_key", "stream_curve_secret_key", "snapshot_key", "prometheus_token")


def _masked(d):
    """A config dict with its secrets (tokens, keys; not their *_file paths) replaced by "<set>" where set."""
    if isinstance(d, dict):
        return {k: ("<set>" if v else v) if k in _SECRETS else _masked(v) for k, v in d.items()}
    return d


if __name__ == "__main__":
    sys.exit(main())
