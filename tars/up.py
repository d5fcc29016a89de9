"""`tars up`: a whole training run on one machine, every role a separate process on loopback.

    tokenizer + policy (fresh, or loaded) -> optional SFT warm start -> envd, inference server, learner, actors
    -> live progress -> stop (budget, max versions, Ctrl-C) -> report.json, learning.png, final/ (HF layout)

The processes are placed, started and stopped by tars.topology (the layout `tars eval` and the fault benchmark
use too): they announce themselves through ready files, die with this process, and on the way out are stopped in
order (actors, learner, inference, envd) with deadlines; anything left is killed, so no orphans remain. While the
run goes on, tars.supervisor restarts a process that dies (backoff, up to supervisor.max_restarts each); the report
counts the restarts.
"""
from __future__ import annotations

import json
import pathlib
import signal
import sys
import time

import torch

from core import config as C
from tars import ctl, report
from tars.supervisor import Supervisor
from tars.topology import LaunchError, StartCancelled, Topology, plan, prepare


def build_model(cfg: C.RunConfig, out: pathlib.Path, say) -> tuple[pathlib.Path, float | None]:
    """The checkpoint directory the run starts from: model.path, or a fresh one in out/model_init (tars/fresh.py);
    then, if configured, the SFT warm start (learner.sft, the same path as `tars sft`) into out/model."""
    from core.chat import open_tokenizer
    from core.model import load_config

    if cfg.model.path:
        src = pathlib.Path(cfg.model.path).resolve()
        load_config(src)                      # an unsupported model: one clear error before anything starts
        open_tokenizer(src, src, cfg.actor.chat_template_kwargs)  # missing, not fitting the model, failing template
    else:
        from tars.fresh import build_model as fresh

        src = fresh(cfg.model, out / "model_init", list(cfg.actor.env_ids), cfg.actor.max_turns, cfg.actor.env_options)
        say(f"fresh model in {src} ({cfg.model.num_layers} layers, d={cfg.model.hidden_size}; BPE tokenizer "
            f"of {open_tokenizer(src).vocab_size} tokens trained on the tasks' text)")
    if cfg.sft.steps <= 0:
        return src, None
    from learner.sft import run as sft_run
    from tars.demos import source, val_source

    t0 = time.perf_counter()
    torch.set_num_threads(2)
    episodes = cfg.sft.episodes or max(2000, cfg.sft.steps * 4)
    say(f"SFT warm start: {episodes} scripted demonstrations ({cfg.sft.demonstrator}), {cfg.sft.steps} steps")
    sft_run(cfg, str(src), str(out / "model"), [], demos=source(cfg, episodes), log=say, val_demos=val_source(cfg))
    return out / "model", time.perf_counter() - t0


ENDED = ("done", "wall budget reached", "target success reached", "interrupted")  # a run that ended as it should


def up(cfg: C.RunConfig, out: str, quiet: bool = False) -> int:
    out_p = pathlib.Path(out).resolve()
    prepare(out_p)
    if not cfg.inference.weights_root:  # the server loads only what this run's learner publishes (or a restart)
        cfg.inference.weights_root = str(out_p / "weights")
    if cfg.telemetry.enabled and not cfg.telemetry.dir and not cfg.telemetry.otlp_endpoint:
        cfg.telemetry.dir = str(out_p / "telemetry")  # every role's spans in the run directory
    C.save(cfg, out_p / "config.yaml")
    ctl.remember_run(out_p)  # `tars ctl` with no flags now talks to this run
    tty = sys.stdout.isatty() and not quiet

    def say(msg: str) -> None:
        if not quiet:
            print(("\r\033[K" if tty else "") + f"[tars up] {msg}", flush=True)

    _set_aside_earlier(out_p, say)
    t_start = time.time()
    try:
        model_dir, sft_s = build_model(cfg, out_p, say)
    except KeyboardInterrupt:  # before any process started: no report, the model directories are written whole
        raise KeyboardInterrupt(f"before training started ({out_p} holds config.yaml and the models written so far, "
                                "no report)") from None
    topo = Topology(plan(cfg, out_p, model_dir))
    interrupted = False

    def on_sigint(*_):
        nonlocal interrupted
        interrupted = True

    old = signal.signal(signal.SIGINT, on_sigint)
    old_term = signal.signal(signal.SIGTERM, on_sigint)
    status, cancelled = "done", False
    sup = None
    live = report.Monitor(out_p).at_end()  # this run's records only: a rerun in the same --out appends to the logs
    try:
        topo.start(cancel=lambda: interrupted)  # Ctrl-C while starting: nothing more is started
        say(f"running: envd {topo.envd}, inference {topo.inference}, learner {topo.stream}, {cfg.actors} actor(s)"
            + (f", judge {topo.judge} ({topo.plan.judge})" if topo.judge else "") + "; Ctrl-C stops")
        sup = Supervisor(topo, cfg.supervisor.max_restarts, cfg.supervisor.backoff_s, hang_s=cfg.supervisor.hang_s,
                         control_token=cfg.control.auth_token,
                         say=(lambda m: say(m) if not tty else print("\r\033[K[tars up] " + m, flush=True)))
        status = _watch(cfg, sup, live, quiet, tty, lambda: interrupted)
        if tty:
            print()
        if status in ENDED:
            say(f"stopping ({status})")
        else:  # the supervisor ended the run: why, on stderr in both modes (--quiet prints nothing else)
            print(f"[tars up] failed: {status}", file=sys.stderr, flush=True)
    except StartCancelled as e:
        status, cancelled = "interrupted", True
        say(f"interrupted while starting ({e}): stopping what was started")
    except LaunchError as e:
        status = f"failed: {e}"
        print(f"[tars up] {status}", file=sys.stderr if quiet else sys.stdout, flush=True)  # --quiet too: why it ended
    finally:
        if sup is not None:
            sup.close()
        topo.stop()
        signal.signal(signal.SIGINT, old)
        signal.signal(signal.SIGTERM, old_term)
    held, status = _held_out(cfg, out_p, model_dir, sft_s is not None, status, t_start, say)
    live.poll()  # what the run logged since the live monitor's last read; the earlier runs' logs are not read again
    rep = report.write_report(out_p, live, wall_s=time.time() - t_start, sft_used=cfg.sft.steps > 0, sft_s=sft_s,
                              status=status, since=t_start, restarts=sup.counts() if sup else {}, held_out=held,
                              max_versions=cfg.max_versions)
    say(f"report: {json.dumps({k: rep[k] for k in ('episodes', 'success_first', 'success_last', 'success_sft', 'policy_version', 'wall_s')})}")
    for w in rep["warnings"]:
        print(f"[tars up] warning: {w}", file=sys.stderr if quiet else sys.stdout, flush=True)
    if rep["written"]:  # only what is there: a failed write is an error line instead
        say(f"wrote {', '.join(rep['written'])}")
    missing = dict(rep["not_written"])
    if cancelled and missing.pop(str(out_p / "final"), None):  # stopped while starting: no export is expected
        say("no final policy: interrupted before training started")
    for path, why in missing.items():
        print(f"[tars up] error: {path} not written: {why}", file=sys.stderr, flush=True)
    if status not in ENDED or missing:
        return 1
    if status == "interrupted":  # Ctrl-C: stopped in order, report written; the exit status says it was cut short
        print(f"tars up: interrupted: stopped in order; report in {out_p / 'report.json'}", file=sys.stderr, flush=True)
        return 130
    return 0


# What an earlier run in the same --out leaves that a new run would take as its own: published versions (a learner
# numbers its first publish after the newest weights/vN), checkpoints (a learner restarted before its first one would
# resume the earlier run's), the WAL (replayed into the new run) and the actors' spools (re-sent to the new learner).
EARLIER_STATE = ("weights", "ckpt", "ckpt.old", "stream.wal", "stream.wal.images", "spool")


def _set_aside_earlier(out_p: pathlib.Path, say) -> None:
    """Moves an earlier run's learner state (EARLIER_STATE) into out/earlier/N/ before this run starts at version 0:
    nothing is deleted (a user can still resume that run's learner from there), and nothing of it reaches this run.
    The logs (episodes.jsonl, learner.jsonl, ...) stay: a run appends to them and its report reads its own records."""
    found = [n for n in EARLIER_STATE if (out_p / n).exists() or (out_p / n).is_symlink()]
    if not found:
        return
    base = out_p / "earlier"
    n = 1 + max((int(d.name) for d in base.glob("*") if d.name.isdigit()), default=0) if base.is_dir() else 1
    dest = base / str(n)
    try:
        dest.mkdir(parents=True)
        for name in found:
            (out_p / name).rename(dest / name)
    except OSError as e:
        raise C.UserError(f"--out {out_p}: cannot move the earlier run's {', '.join(found)} aside into {dest} ({e}); "
                          "move them yourself, or give another --out") from None
    say(f"{out_p} held an earlier run: moved its {', '.join(found)} to {dest} (this run starts at version 0)")


def _held_out(cfg: C.RunConfig, out_p: pathlib.Path, start: pathlib.Path, sft: bool, status: str, t_start: float,
              say) -> tuple[dict | None, str]:
    """evaluation.episodes > 0 and RL ended normally with a final policy: the held-out evaluation (tars/heldout.py)
    -> (its summary or None, the run's status)."""
    if cfg.evaluation.episodes <= 0 or status not in ("done", "wall budget reached", "target success reached"):
        return None, status
    if report.final_problem(out_p / "final", t_start) is not None:
        say("no held-out evaluation: the learner exported no final policy")
        return None, status
    from tars import heldout

    # SIGTERM (systemd stop, `timeout`, a pod ending) as Ctrl-C, as during the run: its default action ended the
    # process at once, with no report.json although training had finished.
    old_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        h = heldout.run(cfg, out_p, start, "SFT" if sft else "start", say)
    except KeyboardInterrupt:
        say(f"held-out evaluation interrupted: {out_p / 'heldout'} holds the episodes that finished")
        return None, "interrupted"
    except Exception as e:  # noqa: BLE001 - the run itself is done; say why its evaluation is missing
        say(f"held-out evaluation failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"[:500]}, status
    finally:
        signal.signal(signal.SIGTERM, old_term)
    say(f"held-out success ({h['episodes_per_task']} episodes a task): {h['start_model']} "
        f"{h['mean_start'] if h['mean_start'] is None else round(h['mean_start'], 3)} -> final "
        f"{h['mean_final'] if h['mean_final'] is None else round(h['mean_final'], 3)} ({out_p / 'heldout' / 'summary.md'})")
    return h, status


def _watch(cfg: C.RunConfig, sup: Supervisor, mon: report.Monitor, quiet: bool, tty: bool, interrupted) -> str:
    """Live progress, and the supervisor's restarts, until the run ends; returns why it ended (the report's status)."""
    t_rl = time.time()
    last_print = 0.0
    while True:
        time.sleep(0.5)
        mon.poll()
        now = time.time()
        if not quiet and (tty or now - last_print > 10):
            line = mon.progress_line(now - t_rl)
            print(("\r\033[K" + line) if tty else f"[tars up] {line}", end="" if tty else "\n", flush=True)
            last_print = now
        end = sup.poll()  # first: a restart that became ready since the last poll is counted even on Ctrl-C
        if interrupted():
            return "interrupted"
        if end is not None:
            return end
        if now - t_rl > cfg.wall_budget_s:
            return "wall budget reached"
        if cfg.target_success and mon.rolling_success() is not None and mon.rolling_success() >= cfg.target_success and mon.episodes >= 10 * cfg.learner.batch_size:
            return "target success reached"
