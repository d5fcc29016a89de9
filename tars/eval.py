"""`tars eval`: run a policy on a benchmark suite, resumably, and write results.json / results.md / results.png.

    tars eval --suite builtin --model runs/q/final --out evals/q [--episodes K] [--tasks a,b] [--concurrency N]
    tars eval --compare evals/a evals/b

Policies (--model):
  a checkpoint directory (HF layout, its tokenizer inside)  -> `tars serve` (local engine) started as a child process
  host:port                                          -> an inference server already running (any engine);
                                                        --tokenizer names the model's tokenizer directory
  random | oracle | noisy:P                          -> scripted baselines (noisy:P: the oracle's action with
                                                        probability P, else the random one)

Model policies run exactly the training path: envd (started as a child `tars envd`, or --envd host:port) holds the
sessions, actor.episode.run_episode builds the prompts, parses the output and steps the env, and the reward and
success are the env's own. So evaluation and training cannot disagree about prompts, parsing or rewards.

Scripted baselines also play through a real envd (one started on loopback in this process, or --envd host:port):
the oracle needs the backend's own state, which envd never sends over the wire, so their sessions are created with
the daemon option `hint_policy=oracle|random|noisy:P` (envd/hints.py) and every result carries the baseline's next
action, computed by the backend's `oracle_action()` / `random_action(rng)` (a backend without `random_action` gets
uniform random clicks on its screen). The policy sends that action back as its Step, so a baseline's score exercises the
same sessions, RPCs and outcome accounting as a model's. An oracle that does not know a task (or a page state) ends
the episode as a failure with the reason in `error`.

Infra errors (a crashed env, a lost daemon, a failed inference call) are recorded with outcome infra_error, counted
apart and excluded from every rate. Results are appended to DIR/episodes.jsonl as episodes finish; a rerun of the
same command skips the (task, episode) pairs already there (--retry-infra re-runs the infra errors).
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import os
import pathlib
import re
import signal
import sys
import time
import uuid

from tars import evaldir
from tars import evalsuite as S
from tars.evalsuite import EvalError  # noqa: F401 - raised here, and imported from here by callers
from core.config import RunConfig

ADDRESS = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d+$")


def _info(info_json: str) -> dict:
    try:
        d = json.loads(info_json or "{}")
        return d if isinstance(d, dict) else {}
    except ValueError:
        return {}


def _record(task: S.TaskSpec, episode: int, seed: int, outcome: str, success: bool, ret: float, steps: int,
            error: str, wall_s: float, info: dict) -> dict:
    r = {"task": task.name, "episode": episode, "env_id": task.env_id, "seed": seed, "outcome": outcome,
         "success": bool(success) and outcome != S.INFRA, "return": float(ret), "steps": int(steps),
         "error": error[:500], "wall_s": round(wall_s, 3), "t": time.time()}
    for k in ("score", "human_score"):
        if isinstance(info.get(k), (int, float)) and not isinstance(info.get(k), bool):
            r[k] = float(info[k])
    return r


class Policy(abc.ABC):
    name: str

    def identity(self) -> str:
        """What this policy is, for eval.json (tars.evaldir): a checkpoint directory's contents, else its name."""
        return evaldir.checkpoint_identity(self.name) if os.path.isdir(self.name) else self.name

    async def start(self, out: pathlib.Path, cancel=None) -> None:
        """Bring up what the policy needs; `cancel()` true (Ctrl-C) ends a slow start early, starting no episode."""

    @abc.abstractmethod
    async def episode(self, task: S.TaskSpec, episode: int, seed: int) -> dict: ...

    async def close(self) -> None:
        pass


# ---- scripted baselines (through envd, with the daemon's hints) -------------------------------------------

class ScriptedPolicy(Policy):
    """`random` / `oracle` / `noisy:P`, played through a real EnvService: sessions are created with `hint_policy`
    (envd.hints), every result carries the baseline's next action, and the policy sends it back as its Step."""

    def __init__(self, kind: str, cfg: RunConfig, envd: str = ""):
        from envd.hints import check

        try:
            check(kind)
        except ValueError as e:
            raise EvalError(f"no scripted policy {kind!r}: {e}") from None
        self.name, self.cfg, self.envd_addr, self.server = kind, cfg, envd, None

    async def start(self, out: pathlib.Path, cancel=None) -> None:
        from actor.envclient import EnvClient
        from envd.server import EnvServer

        if not self.envd_addr:  # a daemon on loopback in this process: backends registered here are served too
            self.server = EnvServer(dataclasses.replace(self.cfg.envd, host="127.0.0.1", port=0))
            await self.server.start()
            self.envd_addr = self.server.address
        a = self.cfg.actor
        self.env = EnvClient(self.envd_addr, self.cfg.envd.auth_token, a.rpc_timeout_s, a.retries,
                             lease_ttl_s=self.cfg.envd.lease_ttl_s)

    async def episode(self, task: S.TaskSpec, episode: int, seed: int) -> dict:
        from actor.envclient import EnvActionError, EnvInfraError
        from core.action import Action
        from envd.hints import OPTION

        t0 = time.monotonic()
        sid, steps, ret, info, outcome, error = "", 0, 0.0, {}, "truncated", ""
        try:
            # the session options a model's episode gets (ModelPolicy): actor.env_options under the task's own
            opts = {**{k: str(v) for k, v in self.cfg.actor.env_options.items()}, **task.options, OPTION: self.name}
            sid, run_id = await self.env.create(task.env_id, seed, opts)
            obs = await self.env.reset(sid, run_id, seed)
            info = _info(obs.info_json)
            while obs.outcome == "running" and steps < (task.max_turns or self.cfg.actor.max_turns):
                action = info.get("hint_action")
                if not action:  # the oracle gives up: a policy failure, not an infra error
                    error = str(info.get("hint_error", f"{self.name}: no action"))
                    break
                steps += 1
                try:
                    obs = await self.env.step(sid, run_id, Action.from_dict(action))
                except EnvActionError as e:  # same accounting as the model path: a wasted turn with a penalty
                    ret += self.cfg.actor.format_penalty
                    error = f"action rejected: {e}"
                    continue
                ret += obs.reward
                info = _info(obs.info_json)
            if obs.outcome == S.INFRA:
                return _record(task, episode, seed, S.INFRA, False, ret, steps, str(info.get("error", ""))[:500],
                               time.monotonic() - t0, info)
            if obs.outcome != "running":
                outcome = obs.outcome
        except EnvInfraError as e:  # any backend or daemon failure is an infra error, never a reward of 0
            return _record(task, episode, seed, S.INFRA, False, ret, steps, str(e)[:500], time.monotonic() - t0, info)
        except EnvActionError as e:  # CreateSession / Reset refused the task's options
            return _record(task, episode, seed, S.INFRA, False, ret, steps, f"refused: {e}"[:500],
                           time.monotonic() - t0, info)
        finally:
            if sid:
                await self.env.close_session(sid)
        return _record(task, episode, seed, outcome, bool(info.get("success", False)), ret, steps, error,
                       time.monotonic() - t0, info)

    async def close(self) -> None:
        env = getattr(self, "env", None)
        if env is not None:
            await env.close()
        if self.server is not None:
            await self.server.stop(grace=1.0)
            self.server = None


# ---- model policies (envd + inference + actor.episode) ----------------------------------------------------

class ModelPolicy(Policy):
    def __init__(self, model: str, cfg: RunConfig, tokenizer: str = "", envd: str = ""):
        self.cfg, self.model, self.envd_addr = cfg, model, envd
        p = pathlib.Path(model)
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise EvalError(f"{model}: not an HF-layout checkpoint (no config.json)")
            self.checkpoint = p.resolve()
            self.tokenizer = tokenizer or str(p)
            self.inference_addr = ""
        elif ADDRESS.match(model):
            if not tokenizer:
                raise EvalError("--model host:port needs --tokenizer (the directory of the policy's tokenizer files)")
            self.checkpoint, self.tokenizer, self.inference_addr = None, tokenizer, model
        else:
            raise EvalError(f"--model {model!r}: not a checkpoint directory, a host:port address, 'random', 'oracle' "
                            "or 'noisy:P'")
        from core.chat import open_tokenizer

        try:  # the tokenizer (and, for a directory, that it fits the model) before anything starts
            self.tok = open_tokenizer(self.tokenizer, self.checkpoint, cfg.actor.chat_template_kwargs)
        except ValueError as e:
            raise EvalError(str(e)) from None
        self.name = str(self.checkpoint or model)
        self.topo = None

    def identity(self) -> str:
        # the weights (a server given by address: only its address is known) and how they are sampled
        return f"{super().identity()} temperature={self.cfg.actor.temperature}"

    async def start(self, out: pathlib.Path, cancel=None) -> None:
        from actor.envclient import EnvClient
        from actor.episode import EpisodeContext
        from core.inference_client import InferenceClient
        from core import config as C
        from tars.topology import StartCancelled, Topology, plan

        C.save(self.cfg, out / "config.yaml")
        # the context the prompts must fit: the config's when this run serves the policy itself; a server given by
        # address answers a prompt that does not fit with "exceeds max_context", which ends the episode the same way
        max_context = 0 if self.inference_addr else self.cfg.inference.request_limit()
        # envd and `tars serve` where no address was given: the topology of a run without learner and actors
        self.topo = Topology(plan(self.cfg, out, self.checkpoint, learner=False, n_actors=0,
                                  envd_addrs=(self.envd_addr,) if self.envd_addr else (),
                                  inference_addr=self.inference_addr))
        try:
            await asyncio.to_thread(self.topo.start, cancel)
        except StartCancelled:  # Ctrl-C while the daemons were starting (a model load can take minutes)
            await self.close()
            return
        except Exception as e:  # a daemon that would not start: a failure of the run (exit 1), not a user error
            await self.close()
            raise RuntimeError(f"the policy's daemons did not start: {e}") from None
        self.envd_addr, self.inference_addr = self.topo.envd, self.topo.inference
        a = self.cfg.actor
        self.env = EnvClient(self.envd_addr, self.cfg.envd.auth_token, a.rpc_timeout_s, a.retries, a.keep_sessions,
                             self.cfg.envd.lease_ttl_s / 2, self.cfg.envd.lease_ttl_s)
        self.infer = InferenceClient([self.inference_addr], self.cfg.inference.auth_token, a.rpc_timeout_s, a.retries,
                                     coalesce=a.coalesce_generate)
        # A judge with servers of its own is asked there, as the actors ask it; one whose server only `tars up` starts
        # (actor.judge_model without actor.judge_inference) is not asked: scores and success are the env's anyway.
        from actor.judge import open_judge
        from actor.uitars import resolve

        self.judge = open_judge(a, self.tok, resolve(a, self.tok), self.cfg.inference.auth_token) \
            if a.judge_inference else None
        unserved = a.unserved_judge

        def ctx(acfg):
            c = EpisodeContext(dataclasses.replace(acfg, judge_mode="off") if unserved else acfg, self.tok,
                               self.infer, "eval", max_context=max_context)
            c.judge = self.judge
            return c
        self._ctx = ctx

    async def episode(self, task: S.TaskSpec, episode: int, seed: int) -> dict:
        from actor.episode import run_episode

        # Per-task step budget and env options; everything else (temperature, penalties, parse rules) is the
        # training config's, so a checkpoint is scored the way it was trained.
        acfg = dataclasses.replace(self.cfg.actor, max_turns=task.max_turns or self.cfg.actor.max_turns,
                                   env_options={**self.cfg.actor.env_options, **task.options})
        from actor.envclient import RecordingEnv

        env = RecordingEnv(self.env)
        t0 = time.monotonic()
        tid = f"eval-{episode:06d}-{uuid.uuid4().hex[:8]}"
        try:
            tr = await run_episode(self._ctx(acfg), env, tid, task.env_id, seed, 0)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. CreateSession refused the options: not a policy failure
            return _record(task, episode, seed, S.INFRA, False, 0.0, 0, f"{type(e).__name__}: {e}",
                           time.monotonic() - t0, {})
        return _record(task, episode, seed, tr.outcome, tr.success, tr.ret, len(tr.turns), tr.error,
                       time.monotonic() - t0, _info(env.obs.info_json if env.obs else ""))

    async def close(self) -> None:
        for name in ("infer", "env"):
            c = getattr(self, name, None)
            if c is not None:
                await c.close()
        if getattr(self, "judge", None) is not None:
            await self.judge.infer.close()
        # Nothing talks to either daemon any more: stop them together (each has its own deadline, then SIGKILL).
        if self.topo is not None:
            await asyncio.to_thread(self.topo.stop, (("envd", "inference"),))
            self.topo = None


def make_policy(model: str, cfg: RunConfig, tokenizer: str = "", envd: str = "") -> Policy:
    if model in ("random", "oracle") or model.startswith("noisy:"):
        return ScriptedPolicy(model, cfg, envd)
    return ModelPolicy(model, cfg, tokenizer, envd)


# ---- the runner -------------------------------------------------------------------------------------------

def _open_log(path: pathlib.Path):
    # A crash can leave half a line: cut it off so the next record starts on a line of its own.
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
    return open(path, "ab")


async def evaluate(suite: S.Suite, policy: Policy, out: str | pathlib.Path, concurrency: int = 8,
                   retry_infra: bool = False, stop: asyncio.Event | None = None, say=print,
                   restart: bool = False) -> dict:
    """Run every (task, episode) not yet in out/episodes.jsonl, then write the results. Returns results.json.

    A directory holding another evaluation (tars.evaldir: suite, seeds, task settings, policy) is refused, or with
    restart=True started over. Records not played on this suite's seeds are left out. The policy is started (its
    daemons brought up) here, after the directory's meta check, and closed on the way out."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**evaldir.suite_meta(suite), "model": policy.name, "policy": policy.identity()}
    evaldir.check(out, meta, restart, say)
    meta = {k: v for k, v in meta.items() if k != "tasks"}  # results.json has its own "tasks"
    log_path = out / "episodes.jsonl"
    records, other = evaldir.current(suite, S.read_episodes(log_path))
    if other and say:
        say(f"[tars eval] {other} record(s) in {log_path} were not played on this suite's seeds: left out")
    done = S.latest(records)
    todo = [(t, i) for i in range(max(t.episodes for t in suite.tasks)) for t in suite.tasks  # round-robin: a
            if i < t.episodes and ((t.name, i) not in done or (retry_infra and done[(t.name, i)]["outcome"] == S.INFRA))]
    total = sum(t.episodes for t in suite.tasks)
    stop = stop or asyncio.Event()
    n_done = {"new": 0, "ok": 0, "scored": 0, "infra": 0}
    t0 = time.monotonic()
    tty = sys.stdout.isatty()
    last_line = [0.0]

    def progress(final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - last_line[0] < (0.5 if tty else 10.0):
            return
        last_line[0] = now
        el = now - t0
        rate = n_done["new"] / el if el > 0 else 0.0
        left = len(todo) - n_done["new"]
        sr = n_done["ok"] / n_done["scored"] if n_done["scored"] else None
        line = (f"[tars eval] {total - left}/{total} episodes  success={'-' if sr is None else f'{sr:.3f}'}  "
                f"infra_errors={n_done['infra']}  {rate:.2f} ep/s  eta {left / rate if rate else 0:.0f}s")
        if tty and say is print:
            print("\r\033[K" + line, end="\n" if final else "", flush=True)
        elif say:
            say(line)

    await policy.start(out.resolve(), stop.is_set)  # after the meta check: a refused directory starts no daemon
    try:
        if done:
            say and say(f"[tars eval] resuming: {total - len(todo)}/{total} episodes already in {log_path}")
        it = iter(todo)
        with _open_log(log_path) as log:
            async def worker() -> None:
                for task, i in it:
                    if stop.is_set():
                        return
                    rec = await policy.episode(task, i, suite.seed_of(task.name, i))
                    log.write((json.dumps(rec) + "\n").encode())
                    log.flush()
                    os.fsync(log.fileno())  # a finished episode survives a crash of this process
                    n_done["new"] += 1
                    if rec["outcome"] == S.INFRA:
                        n_done["infra"] += 1
                    else:
                        n_done["scored"] += 1
                        n_done["ok"] += int(rec["success"])
                    progress()

            workers = [asyncio.create_task(worker()) for _ in range(max(1, min(concurrency, len(todo))))]
            stopper = asyncio.create_task(stop.wait())
            try:
                running = set(workers)
                while running and not stop.is_set():
                    _, running = await asyncio.wait([*running, stopper], return_when=asyncio.FIRST_COMPLETED)
                    running.discard(stopper)
            finally:
                stopper.cancel()
                for w in workers:  # interrupted: episodes in flight are abandoned and run again on resume
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                for w in workers:
                    if not w.cancelled() and w.exception() is not None:
                        raise w.exception()
        progress(final=True)
        records, _ = evaldir.current(suite, S.read_episodes(log_path))
        res = S.summarise(suite, records, {**meta, "complete": not stop.is_set()})
        S.write_results(out, res)
        return res
    finally:
        await policy.close()


def main(a, cfg: RunConfig) -> int:
    """The `tars eval` command (arguments from tars.cli)."""
    if a.compare:
        try:
            evaldir.comparable(a.compare[0], a.compare[1])
            text = S.compare(a.compare[0], a.compare[1], a.out)
        except (S.SuiteError, EvalError) as e:
            print(f"tars eval: {e}", file=sys.stderr)
            return 2
        print(text, end="")
        return 0
    if not (a.suite and a.model and a.out):
        print("tars eval: --suite, --model and --out are needed (or --compare DIR_A DIR_B)", file=sys.stderr)
        return 2
    try:
        only = [x for x in (a.tasks or "").split(",") if x]
        suite = S.load_suite(a.suite, a.episodes, only or None)
        S.check_env_ids(suite, cfg.actor.env_options, local=not a.envd)
        policy = make_policy(a.model, cfg, a.tokenizer, a.envd)
    except (S.SuiteError, EvalError) as e:
        print(f"tars eval: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_run(suite, policy, a.out, a.concurrency, a.retry_infra))


async def _run(suite: S.Suite, policy: Policy, out: str, concurrency: int, retry_infra: bool) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        res = await evaluate(suite, policy, out, concurrency, retry_infra, stop)
    except EvalError as e:
        print(f"tars eval: {e}", file=sys.stderr)
        return 2
    o = res["overall"]
    print(f"[tars eval] {suite.name} / {policy.name}: {S.headline(o)}; wrote {out}/results.json, results.md, "
          "results.png", flush=True)
    for w in res["warnings"]:
        print(f"[tars eval] warning: {w}", flush=True)
    if not res["complete"]:
        print(f"tars eval: interrupted after {o['episodes']}/{o['planned']} episodes: rerun the same command to "
              "resume", file=sys.stderr, flush=True)
        return 130
    return 0
