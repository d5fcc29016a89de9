"""One multi-turn episode, top to bottom: session -> (prompt -> generate -> parse -> step) * turns -> trajectory.

The conversation lives as token ids and is only ever extended, so every turn's prompt is a prefix-cache hit and
the learner trains on exactly the tokens the engine produced (no re-tokenisation mismatch). Every generated token
keeps its behaviour logprob and the policy version that produced it; an episode that spans a weight update simply
carries tokens of two versions. An environment or inference failure ends the episode as infra_error.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from actor.envclient import EnvActionError, EnvClient, EnvInfraError, Obs
from actor.parsing import ParseError, parse_response
from actor.tiny import turn_prompt_ids
from inference_server.client import InferenceClient
from tars import telemetry
from tars.config import ActorConfig
from tars.schema import Trajectory, Turn
from tars.tokenizer import Tokenizer

INVALID_NOTE = "Invalid action. "


@dataclass
class EpisodeContext:
    cfg: ActorConfig
    tok: Tokenizer
    infer: InferenceClient
    actor_id: str
    sent_images: set = field(default_factory=set)   # content hashes already sent on this stream connection


def _obs_ref(obs: Obs, ctx: EpisodeContext, images: dict) -> str:
    if not obs.images:
        return f"text:{hashlib.sha256(obs.text.encode()).hexdigest()[:16]}"
    img = obs.images[-1]
    h = img.sha256 or hashlib.sha256(img.data).hexdigest()
    if h not in ctx.sent_images:  # each screenshot crosses the stream once per connection
        images[h] = bytes(img.data)
        ctx.sent_images.add(h)
    return f"sha256:{h}"


def _success(info_json: str) -> bool:
    try:
        return bool(json.loads(info_json or "{}").get("success", False))
    except (ValueError, AttributeError):
        return False


async def run_episode(ctx: EpisodeContext, env: EnvClient, tid: str, env_id: str, seed: int,
                      start_version: int, group: str = "") -> Trajectory:
    """One episode under an `episode` span (a trace root); the trajectory carries that span as its traceparent so
    the learner step that trains on it can link to it."""
    with telemetry.span("episode", attributes={"tars.trajectory_id": tid, "tars.env_id": env_id, "tars.seed": seed,
                                               "tars.actor": ctx.actor_id, "tars.start_version": start_version}) as sp:
        tr = await _episode(ctx, env, tid, env_id, seed, start_version, group)
        tr.traceparent = telemetry.traceparent()
        telemetry.set_attrs(sp, **{"tars.outcome": tr.outcome, "tars.return": tr.ret, "tars.success": tr.success,
                                   "tars.turns": len(tr.turns), "tars.error": tr.error or None})
    return tr


async def _episode(ctx: EpisodeContext, env: EnvClient, tid: str, env_id: str, seed: int,
                   start_version: int, group: str = "") -> Trajectory:
    cfg, tok = ctx.cfg, ctx.tok
    t_start = time.time()
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    mask: list[int] = []
    turns: list[Turn] = []
    images: dict[str, bytes] = {}
    outcome, ret, success, error, instruction = "truncated", 0.0, False, "", ""
    env_s = gen_s = 0.0
    sid = ""
    try:
        t0 = time.perf_counter()
        with telemetry.client_span("env.create", {"tars.env_id": env_id, "tars.envd": getattr(env, "address", "")}):
            sid, run_id = await env.create(env_id, seed, {k: str(v) for k, v in cfg.env_options.items()})
            obs = await env.reset(sid, run_id, seed)
        env_s += time.perf_counter() - t0
        instruction = obs.instruction
        note = ""
        for turn_i in range(cfg.max_turns):
            with telemetry.span("turn", attributes={"tars.turn": turn_i}) as turn_span:
                # 1. prompt: the new observation appended to the conversation
                prompt = turn_prompt_ids(tok, obs.text, obs.instruction, note)
                obs_ref = _obs_ref(obs, ctx, images)
                tokens += prompt
                logprobs += [0.0] * len(prompt)
                versions += [-1] * len(prompt)
                mask += [0] * len(prompt)
                # 2. generate, sticky to one replica under this trajectory id
                t0 = time.perf_counter()
                with telemetry.client_span("generate", {"tars.prompt_tokens": len(tokens)}) as gsp:
                    g = await ctx.infer.generate(tid, tokens, cfg.max_new_tokens, temperature=cfg.temperature,
                                                 stop_token_ids=[tok.eos_id], timeout_s=cfg.rpc_timeout_s)
                    telemetry.set_attrs(gsp, **{"tars.output_tokens": len(g.output_ids), "tars.replica": g.replica,
                                                "tars.policy_version": max(g.versions, default=-1)})
                gen_ms = (time.perf_counter() - t0) * 1000
                gen_s += gen_ms / 1000
                start = len(tokens)
                tokens += list(g.output_ids)
                logprobs += list(g.logprobs)
                versions += list(g.versions)
                mask += [1] * len(g.output_ids)
                text = tok.decode(g.output_ids)
                # 3. parse; unparseable output gets a format penalty and, by default, another try
                try:
                    _, actions = parse_response(text)
                    action = actions[0].to_env()
                except ParseError as e:
                    turns.append(Turn(obs_ref, text, {}, cfg.format_penalty, start, len(tokens), 0.0, gen_ms, str(e)[:200]))
                    ret += cfg.format_penalty
                    if cfg.on_parse_error == "stop":
                        break
                    note = INVALID_NOTE
                    continue
                # 4. step the environment
                t0 = time.perf_counter()
                try:
                    with telemetry.client_span("env.step", {"tars.action": action.get("type", "")}) as esp:
                        obs = await env.step(sid, run_id, action, raw=text)
                        telemetry.set_attrs(esp, **{"tars.reward": obs.reward, "tars.outcome": obs.outcome})
                except EnvActionError as e:  # well-formed but not applicable here: same as a format error
                    turns.append(Turn(obs_ref, text, action, cfg.format_penalty, start, len(tokens), 0.0, gen_ms, str(e)[:200]))
                    ret += cfg.format_penalty
                    note = INVALID_NOTE
                    continue
                env_ms = (time.perf_counter() - t0) * 1000
                env_s += env_ms / 1000
                note = ""
                turns.append(Turn(obs_ref, text, action, obs.reward, start, len(tokens), env_ms, gen_ms))
                telemetry.set_attrs(turn_span, **{"tars.reward": obs.reward})
                ret += obs.reward
                if obs.outcome == "infra_error":
                    outcome, error = "infra_error", obs.info_json[:500]
                    break
                if obs.outcome != "running":
                    outcome = obs.outcome
                    success = _success(obs.info_json)
                    break
    except EnvInfraError as e:
        outcome, error = "infra_error", str(e)[:500]
    except grpc.aio.AioRpcError as e:  # inference failed after the client's retries
        outcome, error = "infra_error", f"inference: {e.code().name}: {e.details()}"[:500]
    finally:
        if sid:
            await env.close_session(sid)
    return Trajectory(
        id=tid, env_id=env_id, outcome=outcome,
        tokens=np.asarray(tokens, np.int32), logprobs=np.minimum(np.asarray(logprobs, np.float32), 0.0),
        versions=np.asarray(versions, np.int32), mask=np.asarray(mask, np.uint8), turns=turns,
        ret=ret, success=success, group=group, task=instruction, start_version=start_version,
        timings={"start": t_start, "end": time.time(), "env_s": env_s, "gen_s": gen_s},
        actor=ctx.actor_id, images=images, error=error,
    )
