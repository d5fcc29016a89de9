"""SGLang 0.5.23's server-side *behaviour* over a LocalEngine, without the HTTP (standard library only).

What it reproduces (checked against SGLang's http_server.py, tokenizer_manager.py, io_struct.py, weight_versions.py):
- POST /generate {rid, input_ids, sampling_params, return_logprob, logprob_start_len, stream}: {output_ids,
  meta_info{id, finish_reason, prompt_tokens, completion_tokens, cached_tokens, weight_version, weight_versions,
  output_token_logprobs [[lp, id, None]]}}. finish_reason is {"type": "stop", "matched": id} | {"type": "length",
  "length": n} | {"type": "abort", "message", "status_code", "err_type"}; an aborted request answers 200 with its
  partial output (one the server failed, abort status 500 / 503, answers that status with the HTTPException handler's
  ErrorResponse {"object": "error", "message", "type": "503", "param": null, "code": 503}); a
  request whose client disconnected is aborted. EOS and stop_token_ids stop generation unless sampling_params.ignore_eos (which turns both off);
  top_k -1 = off (0 is rejected); temperature 0 = greedy. weight_versions are run-length spans {version, start, end} (end exclusive) over the output tokens.
- Context (the stand-in's max_context is SGLang's context length C): a prompt of C tokens or more, or prompt +
  max_new_tokens >= C, answers 400 {"error": {"message"}} with SGLang's message, and so does a prompt of C - 6 tokens
  or more (the scheduler's input check); max_new_tokens (null: unbounded) is then capped at C - prompt - 2, as SGLang's
  scheduler does.
- sampling_seed: SGLang (with --enable-deterministic-inference, without which it ignores seeds) puts the batch's
  seeds in an int64 tensor, so a seed outside [-2^63, 2^63) fails in its scheduler (which takes the server down); the
  stand-in fails that request with 500 ("Overflow when unpacking long").
- --max-queued-requests N (max_queued_requests): a request arriving while N wait beyond --max-running-requests
  (max_running_requests, the engine's max_batch) is refused at once with 503 "The request queue is full."
  (Scheduler._abort_on_queued_limit); the server stays healthy.
- POST /abort_request {rid | abort_all}: the scheduler aborts every request whose rid STARTS WITH the given rid. With
  one tokenizer worker (SGLang's default) the tokenizer manager first drops the abort unless the rid itself is in
  flight; `tokenizer_workers > 1` skips that guard, as SGLang does.
- POST /pause_generation {mode}: abort (in-flight requests end with finish abort), retract (requests leave the
  engine, keep their tokens and are re-prefilled after /continue_generation, under whatever weights are loaded
  then), in_place (the engine freezes; requests keep their KV and continue after /continue_generation). While
  paused, new /generate calls wait.
- POST /update_weights_from_disk {model_path, weight_version, abort_all_requests, flush_cache=true}:
  {success, message, num_paused_requests}. Not paused: waits until no request is in flight (SGLang's writer lock)
  and holds new ones back; requests still in flight after inference.update_timeout_s fail the update (nothing
  installed: SGLang would wait on; the stand-in keeps a deadline); paused: applies at once (in_place: at the next
  step boundary, after continue).
- POST /update_weights_from_tensor {serialized_named_tensors: [one per TP rank], load_format, flush_cache=true,
  abort_all_requests, weight_version}: {success, message}; the same locking, abort, flush and weight_version
  semantics as from disk; rank 0's entry is decoded (inference_server/sglang_tensors.py: shared-memory handles,
  an allow-listed unpickler). A body FastAPI cannot build the request type from answers 422 {"detail": [...]};
  tensors that do not decode or do not fit the model answer 400 {success: false, message}.
- Where the `sglang` package is importable, every body is also checked against SGLang's own request types
  (inference_server.sglang_types) and refused with 400 and SGLang's message when they refuse it.
- GET /v1/models: {data: [{id, max_model_len}]}, max_model_len the context length (--context-length, by default
  the model's own, as SGLang derives it; one past the model's refuses to start without
  SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1).
- GET|POST /flush_cache (400 while requests are in flight), GET /get_model_info (alias /model_info),
  /get_weight_version, /get_server_info, /health, /health_generate (a 1-token generation, or any request's token
  after the check began, as SGLang counts any scheduler output; 503 if none within `health_timeout_s`, e.g. while
  paused).
Not reproduced: text prompts / `stop` strings (token-in-token-out only, as with --skip-tokenizer-init), prompt
logprobs (logprob_start_len must be -1), images, batch requests, the radix cache's content addressing (prefix hits
come from LocalEngine's per-key cache keyed by the first 16 prompt tokens, so multi-turn prompts hit).

The HTTP side (routes, status codes, streaming) and the command line are in inference_server.sglang_conformance,
whose ConformanceServer is this behaviour behind a socket.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout

from core.config import InferenceConfig
from inference_server.engine import LocalEngine
from inference_server.engine_types import LENGTH, STOP, SamplingParams, WeightLoadError
from inference_server.sglang_types import SGLangTypes

CACHE_KEY_TOKENS = 16
KEEP_KV = 1 << 30
QUEUE_FULL = "The request queue is full."  # SGLang's message for a newcomer its full waiting queue refuses (503)  # in_place pauses keep KV across any number of versions; flushes are done by cache-key epochs


class Refused(ValueError):
    """A request the tokenizer manager refuses (its ValueError): /generate answers 400 {"error": {"message"}}."""


class GenerateCall:
    """One /generate call: tokens accumulate here through on_token, across retract / resume segments."""

    def __init__(self, rid: str, input_ids: list[int], params: SamplingParams):
        self.rid, self.input_ids, self.params = rid, input_ids, params
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish: dict | None = None
        self.cached_tokens = 0
        self.retractions = 0
        self.segment = 0            # bumped when a submission is abandoned, so its late tokens are ignored
        self.future = None
        self.suspended = False
        self.return_logprob = False
        self.done = threading.Event()


class SGLangBehaviour:
    """An SGLang server's state and answers, one method per endpoint; stop() ends it and its engine."""

    def __init__(self, model: str, weight_version: str = "default", cfg: InferenceConfig | None = None,
                 tokenizer_workers: int = 1, health_timeout_s: float = 20.0, token_delay_s: float = 0.0,
                 sglang_types: SGLangTypes | None = None, max_queued_requests: int | None = None,
                 max_running_requests: int | None = None):
        # token_delay_s: sleep after every token (a slower accelerator), so tests can act while requests run.
        # sglang_types: checks against the `sglang` package's request types (default: active when importable).
        # max_running_requests / max_queued_requests: SGLang's --max-running-requests / --max-queued-requests.
        self.types = sglang_types if sglang_types is not None else SGLangTypes.load()
        self.model_path = model
        self.cfg = cfg or InferenceConfig(max_context=1024, max_stale_versions=KEEP_KV)
        if max_running_requests is not None:
            self.cfg = dataclasses.replace(self.cfg, max_batch=int(max_running_requests))
        self.max_queued_requests = max_queued_requests
        self.engine = LocalEngine(self.cfg, model)
        self.eos = self.engine.model.config.eos_ids  # config.json may name several
        self.tokenizer_workers = tokenizer_workers
        self.health_timeout_s = health_timeout_s
        self.token_delay_s = token_delay_s
        self.vstr = {self.engine.version: str(weight_version)}  # engine int version -> SGLang weight_version string
        self.weight_version = str(weight_version)
        self.epoch = 0                     # prefix-cache generation; a flush starts a new one
        self.cv = threading.Condition()
        self.reqs: dict[str, GenerateCall] = {}    # in flight
        self.paused: str | None = None     # None | abort | retract | in_place
        self.updating = False              # an unpaused weight update holds the writer lock
        self.closed = False
        self.last_output = 0.0             # monotonic time of the last token any request got

    # ---- lifecycle -----------------------------------------------------------------------------------
    def shut(self) -> None:
        """Refuse and wake everything that waits (paused requests, handlers waiting for a result)."""
        with self.cv:
            self.closed = True
            self.paused = None
            self.cv.notify_all()

    def stop(self) -> None:
        self.shut()
        self.engine.close()

    # ---- generation ----------------------------------------------------------------------------------
    def _wait_admitted(self) -> None:
        while self.paused is not None or self.updating:
            if self.closed:
                raise RuntimeError("server closed")
            self.cv.wait(0.2)

    def generate(self, body: dict) -> GenerateCall:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("input_ids must be a non-empty list of token ids (this server has no tokenizer)")
        if body.get("logprob_start_len", -1) not in (-1, None):
            raise ValueError("only logprob_start_len=-1 (output logprobs) is supported")
        raw = body.get("sampling_params")
        if not isinstance(raw, dict | None):
            raise ValueError(f"sampling_params must be an object, got {type(raw).__name__}")
        sp = {k: v for k, v in (raw or {}).items() if v is not None}  # SGLang: a null field takes its default

        def num(key, cast, default):
            try:
                return cast(sp.get(key, default))
            except (TypeError, ValueError):
                raise ValueError(f"sampling_params.{key} = {sp[key]!r} is not a {cast.__name__}") from None
        top_k = num("top_k", int, -1)
        if top_k < -1 or top_k == 0:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
        top_p = num("top_p", float, 1.0)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        stop_ids = sp.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
            raise ValueError(f"sampling_params.stop_token_ids must be a list of token ids, got {stop_ids!r:.80}")
        # SGLang (Req._check_token_based_finish) checks stop_token_ids and EOS together, and not at all with ignore_eos.
        # Ids outside the vocabulary are taken, not refused: SGLang keeps them in a set that never matches (so they are
        # left out of what the engine, which refuses them, is given).
        stops = set() if sp.get("ignore_eos", False) else {*stop_ids, *self.eos}
        stops = {t for t in stops if 0 <= t < self.engine.vocab_size}
        # SGLang's context rules, the stand-in's max_context being its context length C: the tokenizer manager refuses a
        # prompt of C tokens or more, and prompt + max_new_tokens >= C (_validate_one_request); the scheduler caps
        # max_new_tokens (null: unbounded) at max_req_len - prompt - 1, max_req_len being C - 1 (init_req_max_new_tokens).
        C, n = self.engine.cfg.max_context, len(ids)
        if n >= C:
            raise Refused(f"The input ({n} tokens) is longer than the model's context length ({C} tokens).")
        null_budget = "max_new_tokens" in (raw or {}) and "max_new_tokens" not in sp
        budget = 1 << 30 if null_budget else num("max_new_tokens", int, 128)
        if not null_budget and budget + n >= C:
            raise Refused(f"Requested token count exceeds the model's maximum context length of {C} tokens. You requested "
                          f"a total of {budget + n} tokens: {n} tokens from the input messages and {budget} tokens for "
                          "the completion. Please reduce the number of tokens in the input messages or the completion "
                          "to fit within the limit.")
        if budget < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {budget}")
        if n >= C - 1 - 5:  # the scheduler's validate_input_length: max_req_input_len = max_req_len - 5 (an abort, 400)
            raise Refused(f"Input length ({n} tokens) exceeds the maximum allowed length ({C - 6} tokens). Use a shorter "
                          "input or enable --allow-auto-truncate.")
        budget = min(budget, max(0, C - 1 - n - 1))
        params = SamplingParams(max_new_tokens=budget, temperature=num("temperature", float, 1.0), top_p=top_p,
                                top_k=max(top_k, 0), stop_token_ids=tuple(sorted(stops)), seed=num("sampling_seed", int, 0))
        self.engine.validate(ids, dataclasses.replace(params, max_new_tokens=max(1, budget)))  # 0 is SGLang's too
        rid = str(body.get("rid") or uuid.uuid4().hex)
        with self.cv:
            self._wait_admitted()
            if rid in self.reqs:
                raise ValueError(f"Duplicate request ID: {rid}")
            r = GenerateCall(rid, ids, params)
            waiting = max(0, len(self.reqs) - self.cfg.max_batch)  # beyond --max-running-requests: the waiting queue
            if self.max_queued_requests is not None and waiting + 1 > self.max_queued_requests:
                # Scheduler._abort_on_queued_limit: the newcomer is aborted with 503, which the tokenizer manager
                # raises as an HTTPException for a non-streamed request.
                r.finish = {"type": "abort", "message": QUEUE_FULL, "status_code": 503}
                r.done.set()
                return r
            r.return_logprob = bool(body.get("return_logprob"))
            if not -(1 << 63) <= params.seed < 1 << 63:  # SamplingBatchInfo: torch.tensor(seeds, dtype=torch.int64)
                r.finish = {"type": "abort", "message": "Overflow when unpacking long", "status_code": 500,
                            "err_type": "InternalServerError"}
                r.done.set()
                return r
            if budget == 0:  # nothing to generate: SGLang answers an empty output at once
                r.finish = {"type": "length", "length": 0}
                r.done.set()
                return r
            self.reqs[rid] = r
            self._submit(r)
        return r

    def _submit(self, r: GenerateCall) -> None:
        """Hand r (with the tokens it has so far) to the engine; called with self.cv held."""
        seg = r.segment
        n = len(r.out)
        ids = r.input_ids + r.out
        p = SamplingParams(**{**r.params.__dict__, "max_new_tokens": r.params.max_new_tokens - n})
        key = f"{self.epoch}:" + ",".join(map(str, ids[:CACHE_KEY_TOKENS]))

        def on_token(t: int, lp: float, v: int) -> None:
            with self.cv:
                if r.segment != seg or r.finish is not None:
                    return
                r.out.append(t)
                self.last_output = time.monotonic()
                r.logprobs.append(lp)
                r.versions.append(v)
                # in_place pause: the engine (this is its thread) stops here until continue_generation.
                while self.paused == "in_place" and not self.closed and r.finish is None:
                    self.cv.wait(0.2)
            if self.token_delay_s:
                time.sleep(self.token_delay_s)

        def done(f) -> None:
            with self.cv:
                if r.segment != seg or r.finish is not None or f.cancelled():
                    return
                if f.exception() is not None:
                    self._finish(r, {"type": "abort", "message": str(f.exception()), "status_code": 500, "err_type": "InternalServerError"})
                    return
                out = f.result()
                if n == 0:
                    r.cached_tokens = out.cached_tokens
                assert out.finish_reason in (STOP, LENGTH)
                self._finish(r, self._ended(r) or {"type": "length", "length": len(r.out)})

        r.future = self.engine.submit(ids, p, key, KEEP_KV, on_token)
        r.future.add_done_callback(done)

    def _finish(self, r: GenerateCall, reason: dict) -> None:
        r.finish = reason
        self.reqs.pop(r.rid, None)
        r.done.set()
        self.cv.notify_all()

    @staticmethod
    def _ended(r: GenerateCall) -> dict | None:
        """The finish r's own tokens give it (its last token a stop id, or its budget spent), else None. The engine
        resolves a request a moment after its last token (token_delay_s widens that moment); SGLang sets the finish in
        the step that made the token, so an abort or a pause after it finds the request finished, not running.
        The budget first, as Req.check_finished does: a stop token as the last allowed token finishes with "length"."""
        if len(r.out) >= r.params.max_new_tokens:
            return {"type": "length", "length": len(r.out)}
        if r.out and r.out[-1] in r.params.stop_token_ids:
            return {"type": "stop", "matched": r.out[-1]}
        return None

    def _abort(self, r: GenerateCall, message: str = "Abort in waiting queue") -> None:
        """With self.cv held: end r now with its partial output (or its own finish, when its tokens already end it)."""
        r.segment += 1
        if r.future is not None:
            r.future.cancel()
        self._finish(r, self._ended(r) or {"type": "abort", "message": message, "status_code": None, "err_type": None})

    def abort_request(self, rid: str = "", abort_all: bool = False) -> int:
        with self.cv:
            if not abort_all:
                if not rid:  # an empty rid would prefix-match everything: SGLang ignores it
                    return 0
                if self.tokenizer_workers == 1 and rid not in self.reqs:
                    return 0
            hit = [r for k, r in self.reqs.items() if abort_all or k.startswith(rid)]
            for r in hit:
                self._abort(r, "Aborted by AbortReq.")
            return len(hit)

    def response(self, r: GenerateCall, final: bool = True) -> dict:
        n = len(r.out)
        meta = {"id": r.rid, "finish_reason": r.finish if final else None, "prompt_tokens": len(r.input_ids),
                "completion_tokens": n, "cached_tokens": r.cached_tokens, "num_retractions": r.retractions,
                "weight_version": self.weight_version}
        if final:
            spans: list[dict] = []
            for i, v in enumerate(r.versions):
                s = self.vstr.get(v, str(v))
                if spans and spans[-1]["version"] == s:
                    spans[-1]["end"] = i + 1
                else:
                    spans.append({"version": s, "start": i, "end": i + 1})
            meta["weight_versions"] = spans or [{"version": self.weight_version, "start": 0, "end": 0}]
            meta["weight_version"] = meta["weight_versions"][-1]["version"]
        if r.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.out)]
        return {"output_ids": list(r.out), "meta_info": meta}

    # ---- pause / weights -----------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        with self.cv:
            if self.paused is not None:
                return
            self.paused = mode
            if mode == "abort":
                for r in list(self.reqs.values()):
                    self._abort(r)
            elif mode == "retract":
                for r in list(self.reqs.values()):
                    if (reason := self._ended(r)) is not None:  # finished, not retracted: resumed, it had nothing left
                        r.segment += 1                          # to make (400) or went on past its stop token
                        self._finish(r, reason)
                        continue
                    r.segment += 1
                    r.future.cancel()
                    r.suspended = True
                    r.retractions += 1
            self.cv.notify_all()

    def resume(self) -> None:
        with self.cv:
            self.paused = None
            for r in self.reqs.values():
                if r.suspended:
                    r.suspended = False
                    self._submit(r)
            self.cv.notify_all()

    def update_weights(self, body: dict, state_dict: dict | None = None) -> tuple[bool, str, int]:
        """/update_weights_from_disk (model_path), or /update_weights_from_tensor with its decoded `state_dict`."""
        path = None if state_dict is not None else body.get("model_path") or ""
        wv = body.get("weight_version")
        t0 = time.monotonic()
        if body.get("abort_all_requests"):
            self.abort_request(abort_all=True)
        with self.cv:
            paused = self.paused
            if paused is None:  # the writer lock: wait for in-flight requests, hold new ones back
                while self.updating:
                    self.cv.wait(0.2)
                self.updating = True
                deadline = time.monotonic() + self.cfg.update_timeout_s
                while self.reqs and time.monotonic() < deadline:
                    self.cv.wait(0.2)
            n_paused = len(self.reqs)
        try:
            if paused is None and n_paused:
                # SGLang's writer lock never lets an update in under running requests; rather than wait without a
                # deadline, the stand-in gives up after update_timeout_s and installs nothing.
                return False, (f"Failed to update weights: {n_paused} requests still in flight after "
                               f"{self.cfg.update_timeout_s:g} s (an update without a pause waits for them)."), n_paused
            version = self.engine.target_version + 1
            try:
                # in_place: the engine thread may be parked in on_token, so the update lands when it resumes.
                fut = self.engine.update_weights(version, path, state_dict, self.cfg.update_timeout_s, wait=paused not in ("in_place",))
            except (WeightLoadError, ValueError) as e:
                return False, f"Failed to update weights: {e}.", n_paused
            with self.cv:
                if wv is not None:
                    self.weight_version = str(wv)
                self.vstr[version] = self.weight_version
                if body.get("flush_cache", True):
                    self.epoch += 1
            del fut
            ms = (time.monotonic() - t0) * 1e3
            msg = f"Succeeded to update model weights in {ms:.0f} ms."
            if wv is not None:
                msg += f" Weight version updated to {wv}."
            return True, msg, n_paused
        finally:
            if paused is None:
                with self.cv:
                    self.updating = False
                    self.cv.notify_all()

    def flush_cache(self) -> bool:
        with self.cv:
            if self.reqs:
                return False
            self.epoch += 1
            return True

    def health_generate(self) -> bool:
        deadline = time.monotonic() + self.health_timeout_s
        with self.cv:
            while self.paused is not None or self.updating:
                if self.closed or time.monotonic() > deadline:
                    return False
                self.cv.wait(0.2)
        # SGLang counts any output of its scheduler after the check began as health (a busy server's tokens too, so
        # a full queue is no failed check), else the check's own one-token generation.
        tic = time.monotonic()
        try:
            f = self.engine.submit([0], SamplingParams(max_new_tokens=1, temperature=0.0))
        except Exception:
            return False
        while time.monotonic() < deadline:
            try:
                f.result(0.1)
                return True
            except FutureTimeout:
                if self.last_output > tic:
                    f.cancel()
                    return True
            except Exception:
                return False
        f.cancel()
        return False

    def tokens_in_flight(self) -> int:
        with self.cv:
            return sum(len(r.out) for r in self.reqs.values())

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version}
