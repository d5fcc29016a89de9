"""The actor process, top to bottom: admission -> many concurrent episodes -> trajectories onto the stream.

Episodes start only when the learner's staleness manager admits them (AReaL's rule), run concurrently on one
event loop (bounded by `concurrency`), and each finished trajectory stays in the sender's outbox until the
learner has written it durably. Pause/resume come over the ControlService.
"""
from __future__ import annotations

import asyncio
import os
import collections
import itertools
import logging
import random
import signal
import time
import uuid

from actor.envclient import EnvClient
from actor.episode import EpisodeContext, run_episode
from actor.judge import open_judge
from core.inference_client import InferenceClient
from core import auth, proc, rpc, telemetry
from core.config import HELD_OUT_SEED_BASE, RunConfig
from core.outcome import ENDED, Fault, Outcome
from core.control import ControlServicer, add_control
from core.stream.sender import TrajectorySender
from core.chat import ChatTokenizer, open_tokenizer

log = logging.getLogger("tars.actor")


def episode_rng(seed: int, actor_id: str, spool_dir: str | None) -> tuple[random.Random, int]:
    """The generator of an actor's task seeds and env choices, and its life: 0 on a first start, n on the n-th
    restart that shares its spool (counted there, in `lives`). A restarted actor must not replay its first life's
    seeds: it would sample the same tasks again, and its GRPO group ids would meet groups the learner still holds
    from before the kill. Without a spool every start is a first one."""
    life = 0
    if spool_dir:
        path = os.path.join(spool_dir, "lives")
        try:
            with open(path) as f:
                life = int(f.read().strip() or 0)
        except FileNotFoundError:
            pass
        except ValueError:  # a torn write of the counter: a life of its own all the same
            life = int(time.time())
        os.makedirs(spool_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(str(life + 1))
        os.replace(path + ".tmp", path)
    return random.Random(f"{seed}-{actor_id}" + (f"-life{life}" if life else "")), life


class Actor:
    def __init__(self, cfg: RunConfig, actor_id: str, envd: list[str], inference: list[str], stream: str,
                 tokenizer: ChatTokenizer, spool_dir: str | None = None):
        self.cfg, self.acfg, self.actor_id = cfg, cfg.actor, actor_id
        self.envs = [EnvClient(a, cfg.envd.auth_token, cfg.actor.rpc_timeout_s, cfg.actor.retries,
                               cfg.actor.keep_sessions, cfg.envd.lease_ttl_s / 2, cfg.envd.lease_ttl_s) for a in envd]
        self.infer = InferenceClient(inference, cfg.inference.auth_token, cfg.actor.rpc_timeout_s, cfg.actor.retries,
                                     unavailable_retry_s=cfg.actor.unavailable_retry_s, coalesce=cfg.actor.coalesce_generate)
        self.sender = TrajectorySender(stream, actor_id, window=cfg.actor.send_window, spool_dir=spool_dir,
                                       max_outbox=cfg.actor.max_outbox,
                                       **_curve_keys(cfg.learner.stream.curve_public_key, cfg.actor))
        # The inference server's context, from the run's config (the server's own answer lowers it: actor/episode.py).
        self.ctx = EpisodeContext(cfg.actor, tokenizer, self.infer, actor_id, max_context=cfg.inference.request_limit())
        # a judge with servers of its own (actor.judge_inference; actor.judge_model its tokenizer), else the policy's
        self.ctx.judge = open_judge(cfg.actor, tokenizer, self.ctx.vision, cfg.inference.auth_token)
        self.rng, self.life = episode_rng(cfg.seed, actor_id, spool_dir)
        self.paused = False
        self.version = 0
        self.counter = itertools.count()
        self.running: set[asyncio.Task] = set()
        self.sending: set[asyncio.Task] = set()
        self._stopping = False  # shutdown(): a send that times out is not tried again
        self.stats = collections.Counter()
        self.recent = collections.deque(maxlen=512)  # (success, outcome) of the latest episodes
        self.t0 = time.monotonic()
        telemetry.observe("tars.actor.episodes", lambda: {str(o): self.stats[o] for o in ENDED},
                          description="episodes finished, by outcome", kind="counter", label="outcome")
        telemetry.observe("tars.actor.episodes_per_s", lambda: self.status()["episodes_per_s"], "1/s",
                          "episodes finished per second since start")
        telemetry.observe("tars.actor.running", lambda: len(self.running), description="episodes in flight")
        telemetry.observe("tars.actor.outbox", self.sender.pending, description="trajectories not yet acknowledged")
        telemetry.observe("tars.actor.paused", lambda: int(self.paused), description="1 while paused")

    # ---- status / control ------------------------------------------------------------------------------------
    def status(self) -> dict:
        ok = [s for s, o in self.recent if o != Outcome.INFRA_ERROR]
        el = time.monotonic() - self.t0
        return {"running": len(self.running), "paused": self.paused, **self.stats, "inference_retries": self.infer.retried,
                "env_sessions_created": sum(e.created for e in self.envs), "env_sessions_reused": sum(e.reused for e in self.envs),
                "episodes_per_s": self.stats["episodes"] / el if el > 0 else 0.0,
                "success_recent": sum(ok) / len(ok) if ok else None, "sender": self.sender.stats()}

    def control(self) -> ControlServicer:
        c = ControlServicer("actor", self.status, lambda: self.version)
        c.on("pause", lambda a: self._set_paused(True))
        c.on("resume", lambda a: self._set_paused(False))
        return c

    def _set_paused(self, p: bool) -> dict:
        self.paused = p
        return {"paused": p}

    # ---- episodes --------------------------------------------------------------------------------------------
    def _new_id(self) -> str:
        # Fixed-width counter + random suffix: no trajectory id is a prefix of another (SGLang matches rids by prefix).
        return f"{self.actor_id}-{next(self.counter):09d}-{uuid.uuid4().hex[:8]}"

    def _pick_env(self) -> EnvClient:
        """The least-loaded daemon among those that have not just failed (all of them if every one has)."""
        live = [e for e in self.envs if e.healthy] or self.envs
        return min(live, key=lambda e: e.inflight)

    def _new_episode(self, group: str, seed: int, env_id: str) -> None:
        task = asyncio.create_task(self._episode(group, seed, env_id))
        self.running.add(task)
        task.add_done_callback(self._finished)

    async def _episode(self, group: str, seed: int, env_id: str):
        """One admitted episode. An infra_error attempt of the environment (a daemon killed or restarted, its backend
        broken) is thrown away and the episode rerun from scratch, under a new id, on a live daemon: nothing of a
        broken attempt is ever sent, so nothing of it can reach the loss. Only when every attempt failed is the last
        one sent, as infra_error (the learner masks it). An attempt that failed because inference stayed down for
        longer than unavailable_retry_s is sent at once as infra_error (fault inference), not rerun."""
        attempts = max(1, self.acfg.episode_attempts)
        for attempt in range(attempts):
            env = self._pick_env()  # the episode then sticks to this daemon (sessions are stateful)
            tr = await run_episode(self.ctx, env, self._new_id(), env_id, seed, self.version, group)
            # Inference down: the client already kept retrying for unavailable_retry_s, and a rerun would only wait
            # as long again while nothing reached the learner (or `tars up`'s screen). Sent at once, infra_error.
            if tr.outcome != Outcome.INFRA_ERROR or attempt == attempts - 1 or tr.fault == Fault.INFERENCE:
                tr.timings["attempts"] = attempt + 1
                if tr.fault == Fault.INFERENCE:
                    self.stats["infra_inference"] += 1
                return tr
            if tr.fault == Fault.ENVD:  # the daemon itself failed us (not its backend, not inference): avoid it a while
                env.mark_down()
            self.stats["episodes_retried"] += 1
            log.info("episode %s attempt %d ended infra_error (%s); retrying", tr.id, attempt + 1, tr.error[:120])
            await asyncio.sleep(0.2 * (attempt + 1))

    def _finished(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # a bug, not an environment failure: count it and give the admission back
            log.error("episode crashed: %r", exc)
            self.stats["episode_crashes"] += 1
            asyncio.ensure_future(self.sender.lost(1))
            return
        tr = task.result()
        self.stats["episodes"] += 1
        self.stats[str(tr.outcome)] += 1
        if tr.truncated_by:
            self.stats[f"truncated_{tr.truncated_by}"] += 1  # what cut it: truncated_context, truncated_max_turns, ...
        self.stats["segments_started"] += len(tr.segments)  # VL image windows and context windows
        self.stats["successes"] += int(tr.success)
        self.recent.append((tr.success, tr.outcome))
        self._send(tr)

    def _send(self, tr) -> None:
        s = asyncio.create_task(self.sender.send(tr, timeout=self.acfg.admission_timeout_s))
        self.sending.add(s)
        s.add_done_callback(lambda task: self._sent(task, tr))

    def _sent(self, task: asyncio.Task, tr) -> None:
        self.sending.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        e = task.exception()
        if isinstance(e, TimeoutError) and not self._stopping:
            # No credit for admission_timeout_s (the learner down, restarting or backlogged): finished work is not
            # dropped; it waits for the learner again (spooled meanwhile, when there is a spool).
            log.warning("send of %s timed out waiting for the learner; trying again", tr.id)
            self.stats["send_retries"] += 1
            self._send(tr)
            return
        if isinstance(e, TimeoutError):  # stopping: the spool, if set, keeps it for the next start (as after a kill)
            log.warning("send of %s timed out while stopping (kept in the spool if one is set)", tr.id)
        else:
            log.error("send of %s failed: %r", tr.id, e)  # never sendable (over the frame limit)
        self.stats["send_failures"] += 1
        asyncio.ensure_future(self.sender.lost(1))  # its admission goes back: the learner stops counting it running

    async def run(self, stop: asyncio.Event) -> None:
        # The learner may be down or restarting: a stop meanwhile ends the wait for its WELCOME (a SIGTERM waited out
        # the whole 60 s, past a service manager's stop grace). Nothing was sent yet; the spool keeps what it holds.
        hello = asyncio.ensure_future(self.sender.start(timeout=60.0))
        await _wait_any({hello}, stop, None)
        if not hello.done():
            hello.cancel()
            await asyncio.wait({hello}, timeout=5.0)
            await self.shutdown(grace_s=1.0)
            return
        hello.result()
        k = max(1, self.cfg.learner.group.size)  # members per seed: the learner's group size, one number
        while not stop.is_set():
            free = self.acfg.concurrency - len(self.running)
            if self.paused or free < k:
                await _wait_any(self.running, stop, 0.2)
                continue
            try:
                granted, self.version = await self.sender.admit((free // k) * k, timeout=5.0)
            except TimeoutError:
                continue
            self.version = max(self.version, self.sender.version)
            whole = (granted // k) * k
            if granted > whole:  # a partial group cannot run: give the admissions back
                await self.sender.lost(granted - whole)
            for _ in range(whole // k):
                seed, env_id = self.rng.randrange(HELD_OUT_SEED_BASE), self.rng.choice(self.acfg.env_ids)
                group = f"{self.actor_id}{f'-l{self.life}' if self.life else ''}-g{seed}" if k > 1 else ""
                for _ in range(k):
                    self._new_episode(group, seed, env_id)
            if whole == 0:
                await _wait_any(self.running, stop, 0.1)
        await self.shutdown()

    async def shutdown(self, grace_s: float = 10.0) -> None:
        # Episodes still running are abandoned: their admissions go back to the learner.
        self._stopping = True
        for t in list(self.running):
            t.cancel()
        if self.running:
            n = len(self.running)
            await asyncio.wait(self.running, timeout=grace_s)
            await self.sender.lost(n)
        if self.sending:
            await asyncio.wait(self.sending, timeout=grace_s)
        try:
            # Acked, or held by a learner that acks at its next checkpoint (which may come after we are gone: the
            # spool keeps those, and a resumed learner acks them as duplicates when they are re-sent).
            await self.sender.flush(timeout=grace_s, held_ok=True)
        except TimeoutError:
            pass
        held = self.sender.stats()["held"]
        if self.sender.pending() > held:
            log.warning("%d trajectories unacknowledged at exit (kept in the spool if one is set)",
                        self.sender.pending() - held)
        if held:
            log.info("%d trajectories held by the learner until its next checkpoint at exit (kept in the spool if one "
                     "is set)", held)
        await self.sender.close()
        await self.infer.close()
        if self.ctx.judge is not None:
            await self.ctx.judge.infer.close()
        for e in self.envs:
            await e.close()


def _curve_keys(server_public: str, acfg) -> dict:
    """With the learner's CURVE public key set, talk CURVE with the actor's keypair (actor.stream_curve_*, which a
    learner with learner.stream.curve_client_keys must list), else with a fresh one (accepted by a learner without
    an allowlist only)."""
    if not server_public:
        return {}
    import zmq

    public, secret = acfg.stream_curve_public_key.encode(), acfg.stream_curve_secret_key.encode()
    if not (public and secret):
        public, secret = zmq.curve_keypair()
    return {"curve_server_key": server_public.encode(), "curve_public_key": public, "curve_secret_key": secret}


async def _wait_any(tasks: set, stop: asyncio.Event, timeout: float | None) -> None:
    waiters = [*tasks, asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiters[-1].cancel()


async def serve(cfg: RunConfig, envd: list[str], inference: list[str], stream: str, tokenizer_path: str,
                actor_id: str = "", control_port: int = 0, ready_file: str | None = None,
                spool_dir: str | None = None) -> None:
    actor_id = actor_id or f"actor-{uuid.uuid4().hex[:6]}"
    model_dir = tokenizer_path if os.path.isfile(os.path.join(tokenizer_path, "config.json")) else None
    # a checkpoint directory: also checked against its embedding
    tok = open_tokenizer(tokenizer_path, model_dir, cfg.actor.chat_template_kwargs)
    actor = Actor(cfg, actor_id, envd, inference, stream, tok, spool_dir)
    # The ControlService binds loopback only; control.auth_token (never a service token) guards it.
    auth.check_listener("actor", "the ControlService", "127.0.0.1", {"control.auth_token": cfg.control.auth_token})
    server = rpc.make_server(auth_token=cfg.control.auth_token)
    add_control(server, actor.control())
    port = rpc.bind(server, "127.0.0.1", control_port)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    proc.write_ready(ready_file, {"role": "actor", "address": f"127.0.0.1:{port}", "actor_id": actor_id})
    try:
        await actor.run(stop)
    finally:
        await server.stop(1.0)


def main(cfg: RunConfig, envd: list[str], inference: list[str], stream: str, tokenizer_path: str,
         actor_id: str = "", ready_file: str | None = None, spool_dir: str | None = None) -> int:
    proc.die_with_parent()
    asyncio.run(serve(cfg, envd, inference, stream, tokenizer_path, actor_id, 0, ready_file, spool_dir))
    return 0
