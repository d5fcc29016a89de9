"""One multi-turn episode, top to bottom: session -> (prompt -> generate -> parse -> step) * turns -> trajectory.

The conversation is token ids, only ever extended (a prefix-cache hit each turn; the learner trains on exactly the
engine's tokens). Each generated token keeps its behaviour logprob and policy version (an episode across a weight
update carries two). An environment or inference failure ends the episode as infra_error. Docs: docs/actor.md.

Screenshots (actor.image_history = k > 0), tiny tars_vision checkpoints: every turn's prompt holds the observation's
text and, when it has a screenshot, a run of <|image|> placeholders; the request carries the last k screenshots,
which the engine binds to the last k runs (core/vision.py). Older turns keep their placeholders as plain tokens, so
only their text speaks for them, and the token sequence is still only ever extended.

Vision-language checkpoints (Qwen2-VL / Qwen2.5-VL, e.g. UI-TARS-1.5; actor/uitars.py): each shown screenshot is a
framed run of the checkpoint's pad count for its size, every run of the current segment bound to its image (the
request's images, in order). A segment holds at most k screenshots: the (k+1)-th starts a new segment, a fresh
first prompt (system prompt, earlier turns' thoughts and actions as text, the new screenshot) appended to the token
arrays, its offset in Trajectory.segments; requests carry the current segment's ids only. Trajectory.image_refs:
each run's image hash in token order. Coordinates are mapped to the screen (actor.coordinates) before envd.

A turn's answer may hold several actions: each a Step, in order, until one ends the episode or envd rejects one (the
format penalty; those before it stay done); the turn's reward sums theirs.

A VL checkpoint may sample a vision token (<|image_pad|>, <|vision_start|>, ...: core.vlm.VLSpec.special_ids), and
with screenshots shown (image_history > 0) a tars_vision one its <|image|> placeholder; its requests stop on them,
and an answer that ends with one is a parse error (the format penalty) that ends the episode as truncated_by
"parse_error": the conversation cannot be extended past an unframed vision token, nor past a placeholder the engine
would bind a screenshot to (or refuse: a run not grid**2 long). Its tokens stay in the trajectory and are trained
on; the learner embeds a VL answer's last sampled token as padding (learner/batch.py).

A truncated episode (actor.max_turns, the env's own step or time limit, on_parse_error=stop, or a vision token the
model wrote) ends with the prompt its next turn would have had, with mask 0, and `boot_at` pointing past it: the
learner's critic bootstraps the return from the value of that state there (core/schema.py).

The context: an observation's text is clipped to actor.max_obs_tokens (with a visible marker, actor/tiny.py). Before
each generate the actor checks that the segment so far + the new prompt + max_new_tokens fits the inference server's
max_context (EpisodeContext.max_context: inference.max_context of the run's config, lowered to what a server says in
an INVALID_ARGUMENT "exceeds max_context" answer, which ends the episode as below, never retried). One that does not
fit starts a new segment (actor.on_context_full=window, the default; as UI-TARS keeps only its last turns): a fresh
first prompt with the earlier turns' thoughts and actions as text (the oldest left out where they do not all fit)
and the new observation, appended to the token arrays like the VL segments above, so nothing is re-tokenised and the
learner computes each segment as its own sequence. A tars_vision conversation with screenshots is not windowed. What
still does not fit (a first prompt alone, or on_context_full=truncate) is a truncation (truncated_by "context"), not
an infra error: it ends with that prompt as its final state and boot_at past it, like any other cut. When even the
first prompt does not fit, the trajectory has no generated token (the learner counts it and drops it).

timings["actor_ms"] / ["actor_cpu_ms"]: each turn's wall / thread CPU time in this module's own code, the awaited env
and inference calls left out (`tars bench actor`'s per-turn overhead).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import grpc
import numpy as np

from actor import judge as J
from actor.envclient import EnvActionError, EnvBackendError, EnvClient, EnvInfraError, Obs
from actor import uitars
from actor.parsing import ParseError, parse_response
from actor.tiny import INVALID_NOTE, clip_observation, first_prompt, turn_ids
from core.inference_client import InferenceClient
from core import telemetry
from core.config import ActorConfig
from core.outcome import Fault, Outcome
from core.schema import Trajectory, Turn
from core.chat import ChatTokenizer
from core.v1 import common_pb2


@dataclass
class EpisodeContext:
    cfg: ActorConfig
    tok: ChatTokenizer
    infer: InferenceClient
    actor_id: str
    judge: J.JudgeModel | None = None   # a judge with servers of its own (J.open_judge); None: the policy judges
    max_context: int = 0   # longest prompt + max_new_tokens the inference server takes (inference.max_context); 0 = unknown
    vision: uitars.Vision | None = None   # resolved from cfg and the tokenizer's checkpoint directory when None

    def __post_init__(self):
        if self.cfg.judge_mode not in ("off", "replace", "add"):
            raise ValueError(f"actor.judge_mode must be off, replace or add, got {self.cfg.judge_mode!r}")
        from actor.tiny import system_prompt

        system_prompt(self.cfg.system_prompt, "")  # ValueError for an unknown style, before any episode
        if self.vision is None:
            self.vision = uitars.resolve(self.cfg, self.tok)
        if self.cfg.judge_on_error not in ("infra_error", "env"):
            raise ValueError(f"actor.judge_on_error must be infra_error or env, got {self.cfg.judge_on_error!r}")


def _obs_ref(obs: Obs, images: dict) -> str:
    # The trajectory carries every screenshot it refers to; the stream sender sends each one once per learner
    # connection and refers to it by hash afterwards (core/stream/images.py).
    if not obs.images:
        return f"text:{hashlib.sha256(obs.text.encode()).hexdigest()[:16]}"
    img = obs.images[-1]
    h = hashlib.sha256(img.data).hexdigest()  # our own hash: the learner checks bytes against it
    images.setdefault(h, bytes(img.data))
    return f"sha256:{h}"


def _screenshot(obs: Obs) -> bytes:
    return bytes(obs.images[-1].data) if obs.images else b""


@dataclass
class _Prompt:
    ids: list[int]          # what the turn appends
    shot: bytes = b""       # the screenshot shown as an image run in it (b"" for none)
    new_segment: bool = False


def _prompt(ctx: EpisodeContext, *a, history: list[str] | None = None, **kw) -> _Prompt:
    """_prompt_once; a new segment whose history of earlier turns does not fit the context leaves out its oldest steps
    (as UI-TARS keeps only its last turns): the fewest that make it fit (all when none does), found by bisection (the
    prompt shrinks as steps are left out): O(log steps) renders a turn, not one per step left out."""
    p, n, limit = _prompt_once(ctx, *a, history=history, **kw), len(history or ()), ctx.max_context - ctx.cfg.max_new_tokens
    if not (p.new_segment and ctx.max_context and len(p.ids) > limit and n):
        return p
    tried, lo, hi = {}, 1, n          # the answer is in [lo, hi]; skipping all n is taken even when it does not fit
    while lo < hi:
        mid = (lo + hi) // 2
        tried[mid] = _prompt_once(ctx, *a, history=history, skip=mid, **kw)
        lo, hi = (lo, mid) if len(tried[mid].ids) <= limit else (mid + 1, hi)
    return tried.get(lo) or _prompt_once(ctx, *a, history=history, skip=lo, **kw)


def _prompt_once(ctx: EpisodeContext, style: str, obs: Obs, note: str, first: bool, closed: bool,
                 seg_images: int = 0, history: list[str] | None = None, window: bool = False, skip: int = 0) -> _Prompt:
    """The tokens a turn appends for `obs`. Text and tars_vision checkpoints: the user message opens with a
    screenshot's placeholder run when shown, then its text; the first turn's carries the system prompt. VL
    checkpoints (actor/uitars.py): the screenshot as a framed run of its own pad count (shown alone), and a new
    segment when it would be the (k+1)-th image of the current one (`seg_images` shown so far). A new segment's
    first prompt carries the earlier turns (`history`) as text; window: a new segment anyway (the conversation
    outgrew the context), leaving out its first `skip` steps. An unreadable screenshot is envd's fault."""
    cfg, tok, vis = ctx.cfg, ctx.tok, ctx.vision
    shot = _screenshot(obs)
    new = window and not first
    if not vis.vl:
        n_img = cfg.image_tokens if vis.image_history > 0 and shot and tok.image_id >= 0 else 0
        past = uitars.history_text(history or [], skip) if new else ""
        return _Prompt(turn_ids(tok, style, obs.text, obs.instruction, past + note, first=first or new, closed=closed,
                                images=n_img, obs_budget=cfg.max_obs_tokens), shot if n_img else b"", new)
    show = bool(shot) and vis.image_history > 0
    try:
        n_img = vis.tokens(shot) if show else 0
    except ValueError as e:
        raise EnvInfraError(f"envd sent a screenshot that cannot be read: {e}") from None
    new = new or (show and not first and seg_images >= vis.image_history)
    past = uitars.history_text(history or [], skip) if new else ""
    if style in uitars.UITARS_STYLES:
        seen = [n_img] if n_img else [clip_observation(tok, obs.text, cfg.max_obs_tokens)]
        user = [t for t in (past + note,) if t] + seen
        ids = (first_prompt(tok, style, uitars.system_text(style, obs.instruction, vis.point_form()), user)
               if first or new else tok.next_turn(user, closed))
    else:
        ids = turn_ids(tok, style, obs.text, obs.instruction, past + note, first=first or new, closed=closed,
                       images=n_img, obs_budget=cfg.max_obs_tokens)
    return _Prompt(ids, shot if n_img else b"", new)


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
    shown: list[bytes] = []          # tars_vision: screenshots of the turns whose prompt has a placeholder run
    vis = ctx.vision
    style = vis.style(cfg.system_prompt, env_id)
    seg_start = 0                    # VL: where the current segment starts in the token arrays
    segments: list[int] = []         # VL: offsets of the segments after the first (Trajectory.segments)
    seg_shots: list[bytes] = []      # VL: the images of the current segment's runs, in order
    image_refs: list[str] = []       # VL: sha256 hex of every run's image, in token order
    history: list[str] = []          # VL: each turn's thought and actions as text, for a new segment's first prompt
    steps: list[J.Step] = []         # what the judge sees
    actor_ms: list[float] = []
    actor_cpu_ms: list[float] = []
    outcome, ret, success, error, instruction = Outcome.TRUNCATED, 0.0, False, "", ""
    fault = Fault.NONE
    cut = ""                         # what cut a truncated episode (core.schema.CUTS); set where it is cut
    note = ""
    env_s = gen_s = 0.0
    sid = run_id = ""
    options = uitars.session_options(cfg, vis)   # screenshots off where nothing reads them
    clean = False                    # the episode ran to its end without an error: its session may be reused
    closed = True                    # the last output ended with the end-of-turn token
    obs = None
    # Image tokens are input-only (VL: the vision tokens; tars_vision: the placeholder, while screenshots are shown);
    # generation stops on one (uitars.stray cuts an engine that did not)
    stray_ids = frozenset(vis.spec.special_ids) if vis.vl else \
        frozenset({tok.image_id}) if vis.image_history > 0 and tok.image_id >= 0 else frozenset()
    stop_ids = sorted({*tok.stop_ids, *stray_ids})

    def append(p: _Prompt) -> None:
        """Append a prompt to the token arrays: a new segment starts here, a shown screenshot is recorded."""
        nonlocal seg_start, seg_shots
        if p.new_segment:
            segments.append(len(tokens))
            seg_start, seg_shots = len(tokens), []
        if p.shot:
            if vis.vl:
                seg_shots.append(p.shot)
                h = hashlib.sha256(p.shot).hexdigest()
                images.setdefault(h, p.shot)
                image_refs.append(h)
            else:
                shown.append(p.shot)   # the user message opens with its placeholders, then the text
                del shown[:-max(1, vis.image_history)]   # requests carry only the last image_history of them
        tokens.extend(p.ids)
        logprobs.extend([0.0] * len(p.ids))
        versions.extend([-1] * len(p.ids))
        mask.extend([0] * len(p.ids))

    try:
        t0 = time.perf_counter()
        with telemetry.client_span("env.create", {"tars.env_id": env_id, "tars.envd": getattr(env, "address", "")}):
            sid, run_id, obs = await env.open(env_id, seed, options)
        env_s += time.perf_counter() - t0
        instruction = obs.instruction
        note = ""
        for turn_i in range(cfg.max_turns):
            t_turn, waited = time.perf_counter(), 0.0
            c_turn = time.thread_time()
            try:
                with telemetry.span("turn", attributes={"tars.turn": turn_i}) as turn_span:
                    # 1. prompt: the new observation after the conversation; one that does not fit the context
                    #    cuts the episode here (it becomes the final state, appended below like any other cut)
                    p = _prompt(ctx, style, obs, note, first=not tokens, closed=closed, seg_images=len(seg_shots),
                                history=history)
                    # the request: the current segment's ids (a new segment's are only its first prompt)
                    request = p.ids if p.new_segment else tokens[seg_start:] + p.ids
                    need = len(request) + cfg.max_new_tokens
                    # window: a new segment (not for tars_vision screenshots: their runs bind across turns)
                    if ctx.max_context and need > ctx.max_context and cfg.on_context_full == "window" and tokens \
                            and not p.new_segment and (vis.vl or not (p.shot or shown)):
                        p = _prompt(ctx, style, obs, note, first=False, closed=closed, history=history, window=True)
                        request = p.ids
                        need = len(request) + cfg.max_new_tokens
                    if ctx.max_context and need > ctx.max_context:
                        cut, error = "context", (f"context: prompt ({len(request)} tokens) + max_new_tokens "
                                                 f"({cfg.max_new_tokens}) exceeds max_context {ctx.max_context}")
                        break
                    shot = _screenshot(obs)
                    if vis.vl:   # every run of the segment, in order
                        window = ([] if p.new_segment else seg_shots) + ([p.shot] if p.shot else [])
                    else:        # tars_vision: the last k runs
                        window = ([*shown, p.shot] if p.shot else shown)[-vis.image_history:] if vis.image_history > 0 else []
                    # 2. generate, sticky to one replica under this trajectory id
                    t0, c0 = time.perf_counter(), time.thread_time()
                    with telemetry.client_span("generate", {"tars.prompt_tokens": len(request)}) as gsp:
                        try:
                            async with env.keepalive(sid):   # a slow generate must not cost the session its lease
                                g = await ctx.infer.generate(tid, request, cfg.max_new_tokens,
                                                             temperature=cfg.temperature, stop_token_ids=stop_ids,
                                                             timeout_s=cfg.rpc_timeout_s,
                                                             images=[common_pb2.Image(data=b) for b in window])
                        except grpc.aio.AioRpcError as e:
                            limit = J.context_limit(e)
                            if limit is None:
                                raise
                            # The server's own limit is lower than the config said (or the config did not say):
                            # the same cut, and later episodes check against it before asking.
                            ctx.max_context = min(ctx.max_context or limit, limit)
                            cut, error = "context", f"context: {e.details()}"[:500]
                            waited += (time.perf_counter() - t0) * 1000
                            c_turn += time.thread_time() - c0
                            break
                        telemetry.set_attrs(gsp, **{"tars.output_tokens": len(g.output_ids), "tars.replica": g.replica,
                                                    "tars.policy_version": max(g.versions, default=-1)})
                    c_turn += time.thread_time() - c0
                    obs_ref = _obs_ref(obs, images)
                    append(p)
                    gen_ms = (time.perf_counter() - t0) * 1000
                    gen_s += gen_ms / 1000
                    waited += gen_ms
                    out_ids, out_lp, out_v = list(g.output_ids), list(g.logprobs), list(g.versions)
                    wrote = uitars.stray(out_ids, stray_ids)
                    if wrote >= 0:   # as if the engine had stopped on it, as asked: the same prefix, the same logprobs
                        out_ids, out_lp, out_v = out_ids[:wrote + 1], out_lp[:wrote + 1], out_v[:wrote + 1]
                    start = len(tokens)
                    tokens += out_ids
                    logprobs += out_lp
                    versions += out_v
                    mask += [1] * len(out_ids)
                    closed = bool(out_ids) and out_ids[-1] == tok.eot_id
                    text = tok.decode(out_ids)
                    # The judge's history: screenshots only with a judge, and only the last judge_images of them.
                    steps.append(J.Step(obs.text, text.strip(), shot if cfg.judge_mode != "off" else b""))
                    if len(steps) > cfg.judge_images:
                        steps[-cfg.judge_images - 1].image = b""
                    # 3. parse; unparseable output gets a format penalty and, by default, another try. An answer
                    #    that wrote a vision token is one too, and ends the episode: no request can extend a
                    #    conversation past an unframed vision token (the engine binds every run to an image).
                    try:
                        if wrote >= 0:
                            raise ParseError(f"the model wrote a vision token ({tok.decode(out_ids[-1:], False)}), "
                                             "which only a screenshot's image run may hold; the episode cannot go on")
                        thought, actions = parse_response(text)
                    except ParseError as e:
                        history.append(uitars.step_text("", None, text))
                        turns.append(Turn(obs_ref, text, {}, cfg.format_penalty, start, len(tokens), 0.0, gen_ms, str(e)[:200]))
                        ret += cfg.format_penalty
                        note = INVALID_NOTE  # what the next prompt says (the bootstrap state, if this stops here)
                        if cfg.on_parse_error == "stop" or wrote >= 0:
                            cut = "parse_error"
                            break
                        continue
                    history.append(uitars.step_text(thought, actions, text))
                    # model coordinates -> screen pixels of the observation the model saw
                    try:
                        actions = vis.to_screen(actions, (obs.width, obs.height), shot)
                    except ValueError as e:
                        raise EnvInfraError(f"envd sent a screenshot that cannot be read: {e}") from None
                    done = {**actions[0].to_dict(), **({"then": [a.to_dict() for a in actions[1:]]} if len(actions) > 1 else {})}
                    # 4. step the environment with every action of the answer, in order, until one ends the episode
                    #    or is rejected; the turn's reward is the sum of theirs
                    obs, reward, rejected, env_ms, ran, cpu_s = await _act(env, sid, run_id, obs, actions, text)
                    c_turn += cpu_s
                    waited += env_ms
                    env_s += env_ms / 1000
                    if len(actions) > 1:
                        done["ran"] = ran   # the actions envd carried out
                    if rejected:
                        reward += cfg.format_penalty
                        turns.append(Turn(obs_ref, text, done, reward, start, len(tokens), env_ms, gen_ms, rejected))
                        ret += reward
                        note = INVALID_NOTE
                        continue
                    note = ""
                    turns.append(Turn(obs_ref, text, done, reward, start, len(tokens), env_ms, gen_ms))
                    telemetry.set_attrs(turn_span, **{"tars.reward": reward})
                    ret += reward
                    if obs.outcome == Outcome.INFRA_ERROR:
                        outcome, fault, error = Outcome.INFRA_ERROR, Fault.ENV, obs.info_json[:500]
                        break
                    if obs.outcome != Outcome.RUNNING:
                        outcome = obs.outcome
                        success = obs.success
                        cut = "env" if outcome == Outcome.TRUNCATED else ""
                        break
            finally:
                actor_ms.append((time.perf_counter() - t_turn) * 1000 - waited)
                actor_cpu_ms.append((time.thread_time() - c_turn) * 1000)
        else:
            cut = "max_turns"
        clean = outcome != Outcome.INFRA_ERROR
    except EnvInfraError as e:   # the daemon failed us, or (EnvBackendError: a Reset answered INFRA_ERROR) its backend
        fault = Fault.ENV if isinstance(e, EnvBackendError) else Fault.ENVD
        outcome, error = Outcome.INFRA_ERROR, str(e)[:500]
    except grpc.aio.AioRpcError as e:  # inference failed after the client's retries
        outcome, fault, error = Outcome.INFRA_ERROR, Fault.INFERENCE, f"inference: {e.code().name}: {e.details()}"[:500]
    finally:
        if sid:
            await env.release(sid, run_id, env_id, options, reuse=clean)
    verdict: dict = {}
    if cfg.judge_mode != "off" and outcome != Outcome.INFRA_ERROR and obs is not None:
        outcome, ret, error, verdict = await _judge(ctx, tid, instruction, steps, obs, turns, outcome, ret, error)
        if outcome == Outcome.INFRA_ERROR:  # no verdict, and judge_on_error says that is not a verdict of 0
            fault = Fault.JUDGE
    boot_at = 0
    if outcome == Outcome.TRUNCATED and obs is not None:
        # Cut by a limit, not over: the state it was cut in (the next turn's prompt) still has a value, which the
        # learner's critic reads at boot_at. Appended, never re-tokenised, like every prompt before it.
        try:
            append(_prompt(ctx, style, obs, note, first=not tokens, closed=closed, seg_images=len(seg_shots),
                           history=history))
            boot_at = len(tokens)
        except EnvInfraError as e:   # its screenshot is unreadable: no state to bootstrap from
            outcome, fault, error = Outcome.INFRA_ERROR, Fault.ENVD, str(e)[:500]
    return Trajectory(
        id=tid, env_id=env_id, outcome=outcome,
        tokens=np.asarray(tokens, np.int32), logprobs=np.minimum(np.asarray(logprobs, np.float32), 0.0),
        versions=np.asarray(versions, np.int32), mask=np.asarray(mask, np.uint8), turns=turns,
        ret=ret, success=success, group=group, task=instruction, start_version=start_version,
        timings={"start": t_start, "end": time.time(), "env_s": env_s, "gen_s": gen_s, "actor_ms": actor_ms,
                 "actor_cpu_ms": actor_cpu_ms},
        actor=ctx.actor_id, images=images, error=error, judge=verdict,
        fault=fault, boot_at=boot_at, truncated_by=(cut or "max_turns") if outcome == Outcome.TRUNCATED else "",
        segments=segments, image_refs=image_refs,
    )


async def _act(env: EnvClient, sid: str, run_id: str, obs: Obs, actions: list, text: str):
    """Step the environment with every action of an answer, in order, until one ends the episode or is rejected.

    Returns (the last observation, the summed reward, the rejection message or "", env ms, actions run, the thread
    CPU seconds spent inside the calls, which are not the actor's own)."""
    reward, rejected, env_ms, ran, cpu_s = 0.0, "", 0.0, 0, 0.0
    for action in actions:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            with telemetry.client_span("env.step", {"tars.action": action.type}) as esp:
                obs = await env.step(sid, run_id, action, raw=text)
                telemetry.set_attrs(esp, **{"tars.reward": obs.reward, "tars.outcome": obs.outcome})
        except EnvActionError as e:  # well-formed but not applicable here: same as a format error
            rejected = str(e)[:200]
            break
        finally:
            cpu_s += time.thread_time() - c0
            env_ms += (time.perf_counter() - t0) * 1000
        reward += obs.reward
        ran += 1
        if obs.outcome != Outcome.RUNNING:
            break
    return obs, reward, rejected, env_ms, ran, cpu_s


async def _judge(ctx: EpisodeContext, tid: str, instruction: str, steps: list, obs: Obs, turns: list[Turn],
                 outcome: Outcome, ret: float, error: str):
    """Ask the judge; returns (outcome, return, error, verdict dict) with the verdict's reward applied."""
    cfg = ctx.cfg
    try:
        judge = ctx.judge or J.JudgeModel(ctx.infer, ctx.tok, ctx.vision, ctx.max_context)
        v = await J.ask(judge, cfg, tid, instruction, steps, obs.text, _screenshot(obs))
    except J.JudgeError as e:
        if cfg.judge_on_error == "infra_error":  # no verdict is not a verdict of 0
            return Outcome.INFRA_ERROR, ret, f"judge: {e}"[:500], {"error": str(e)[:200]}
        return outcome, ret, error, {"error": str(e)[:200], "fallback": "env"}
    reward = cfg.judge_weight * v.score
    if turns:
        last = turns[-1]
        if cfg.judge_mode == "replace":
            # Env rewards out, format penalties kept (a turn whose action was rejected keeps its penalty, not the
            # rewards of the actions before it that ran), the verdict on the last turn.
            for t in turns:
                t.reward = cfg.format_penalty if t.parse_error else 0.0
        last.reward += reward
        ret = sum(t.reward for t in turns) if cfg.judge_mode == "replace" else ret + reward
    return outcome, ret, error, {**v.to_dict(), "reward": reward, "mode": cfg.judge_mode}
