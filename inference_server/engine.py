"""The `local` inference engine: an embedded torch CausalLM behind a continuous-batching scheduler thread.

Callers (the gRPC front, tests, benchmarks) submit requests from any thread and get a concurrent Future;
requests and checked weight updates go into a bounded WorkQueue (inference_server.work_queue), and everything that
touches the model or the KV caches runs in the one scheduler thread (inference_server.scheduler) that drains it,
so the model needs no locks and weight updates land exactly between two steps. Imports point one way only:
engine -> scheduler -> work_queue -> engine_types.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from concurrent.futures import Future

import torch

from core.config import InferenceConfig, UserError
from core.device import resolve_device, resolve_precision
from core.model import CausalLM
# The shared types are re-exported here: callers import the engine's vocabulary from the engine.
from inference_server.engine_types import (GREEDY_BELOW, LENGTH, STOP, EngineClosed, GenerateOutput, QueueFull,  # noqa: F401
                                           Request, SamplingParams, TokenCallback, UpdateBusy, VLInputs,
                                           WeightLoadError, WeightsRefused, WeightUpdate, check_finite, check_request,
                                           check_version_step, finite)
from inference_server.scheduler import Scheduler
from inference_server.work_queue import WorkQueue


class LocalEngine:
    """Continuous batching over one CausalLM with a per-trajectory prefix cache and versioned weights."""

    accepts_images = True  # bound to placeholder tokens when the model has the vision module, else ignored

    def __init__(self, cfg: InferenceConfig, model: CausalLM | str, version: int = 0, start: bool = True, name: str = "local",
                 vl=None):
        """model: a checkpoint directory or a CausalLM. vl: for a Qwen2-VL / Qwen2.5-VL model given in memory, its
        checkpoint directory or core.vlm.VLSpec (the image processor and the vision token ids); read from the
        directory when `model` is one."""
        self.cfg = cfg
        # inference.device / inference.precision: ConfigError (exit 2 from `tars serve`) before any weight is read
        # when CUDA is asked for and not there. A model given as an object is moved there (a no-op when it is).
        self.device = resolve_device(cfg.device, "inference.device")
        self.dtype = resolve_precision(cfg.precision, self.device, "inference.precision")
        path = model if isinstance(model, str) else None
        lm = CausalLM.load_hf(model, dtype=self.dtype) if path is not None else model
        self.model = lm.to(device=self.device, dtype=self.dtype).eval()
        if path is not None:
            _check_loaded(self.model, path, self.dtype)
        self.vl_spec = None
        if self.model.visual is not None:
            from core.vlm import VLSpec

            src = vl if vl is not None else path
            self.vl_spec = VLSpec.load(src) if isinstance(src, (str, bytes)) or hasattr(src, "__fspath__") else src
        self.name = name
        torch.set_num_threads(max(1, cfg.threads))
        self._target_version = int(version)
        self._update_lock = threading.Lock()
        self._shapes = {k: tuple(v.shape) for k, v in self.model.hf_state_dict().items()}
        self.stats = collections.Counter()
        self.batch_hist = collections.Counter()
        self.started = time.monotonic()
        self._queue = WorkQueue(cfg.max_queue, self.stats)
        self._sched = Scheduler(cfg, self.model, self._queue, self.stats, self.batch_hist, int(version))
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._sched.run, name="tars-engine", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the scheduler; pending and running requests fail with EngineClosed."""
        self._queue.close()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._sched.fail_all(EngineClosed("engine closed"))

    @property
    def version(self) -> int:
        """The weight version installed now (set by the scheduler thread when an update lands)."""
        return self._sched.version

    @property
    def target_version(self) -> int:
        """The newest version update_weights has accepted: installed, or queued to be installed."""
        return self._target_version

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} of the weights update_weights accepts (checked early by streamed updates)."""
        return dict(self._shapes)

    # ---- requests ------------------------------------------------------------------------------------
    def validate(self, input_ids: list[int], p: SamplingParams) -> None:
        """Raise ValueError (INVALID_ARGUMENT) with a message naming the offending field (engine_types.check_request)."""
        check_request(input_ids, p, self.vocab_size, self.cfg.max_context)

    def submit(self, input_ids: list[int], params: SamplingParams | None = None, trajectory_id: str = "",
               max_stale_versions: int | None = None, on_token: TokenCallback | None = None,
               images: list[bytes] = ()) -> Future:
        """Queue a request; the Future resolves to a GenerateOutput. Cancel the Future to stop the request.

        Raises ValueError for a bad request and QueueFull when cfg.max_queue requests are already waiting.
        """
        params = params or SamplingParams()
        input_ids = [int(t) for t in input_ids]
        self.validate(input_ids, params)
        if 0 < params.temperature < GREEDY_BELOW:  # dividing by 1e-44 overflows to inf: NaN logprobs
            params = dataclasses.replace(params, temperature=0.0)
        stale = self.cfg.max_stale_versions if max_stale_versions is None else int(max_stale_versions)
        if stale < 0:
            raise ValueError(f"max_stale_versions must be >= 0, got {stale}")
        # A seeded request's generator draws where the engine samples (a torch.Generator is bound to one device).
        gen = torch.Generator(device=self.device).manual_seed(int(params.seed)) if params.seed else None
        req = Request(input_ids, params, trajectory_id, stale, Future(), on_token, frozenset(int(t) for t in params.stop_token_ids),
                      gen, t_submit=time.monotonic())
        if self.model.visual is not None:
            self._bind_vl_images(req, list(images))
        elif images:
            self._bind_images(req, list(images))
        self._queue.put_request(req)  # EngineClosed / QueueFull
        return req.future

    def _bind_images(self, req: Request, images: list[bytes]) -> None:
        v = self.model.vision_config
        if v is None:  # a text-only checkpoint: the prompt's text speaks for the screenshots
            self.stats["images_ignored"] += len(images)
            return
        import hashlib

        from core.vision import bind, placeholder_runs

        req.img_pos, req.img_pix = bind(req.input_ids, images, v)  # ValueError -> INVALID_ARGUMENT
        runs = placeholder_runs(req.input_ids, v)[-len(images):]
        req.img_key = {s: hashlib.sha256(b).hexdigest() for s, b in zip(runs, images)}
        self.stats["images"] += len(images)

    def _bind_vl_images(self, req: Request, images: list[bytes]) -> None:
        """A VL model: the images bind to all the framed runs of input_ids, in order (core.vlm.bind_runs); their
        pixels, grids and the prompt's M-RoPE positions go with the request; ValueError -> INVALID_ARGUMENT."""
        import hashlib

        from core.vlm import bind_runs, image_runs, png_size, rope_positions

        spec = self.vl_spec
        if spec is None:
            if images or image_runs(req.input_ids, self.model.rope_facts.image_token_id):
                raise ValueError("this engine serves a VL model given in memory without its checkpoint directory "
                                 "(LocalEngine(vl=DIR)): it cannot read images")
            return
        runs = bind_runs(req.input_ids, [png_size(b) for b in images], spec)
        if not runs:
            return  # text only: plain positions (all three M-RoPE components equal)
        pv, thw = spec.pixels(images)
        pos, delta = rope_positions(req.input_ids, thw, spec)
        per = [int(n) for n in thw.prod(-1).tolist()]
        req.vl = VLInputs(runs, list(torch.split(pv, per)), thw, pos, delta)
        req.img_key = {s: hashlib.sha256(b).hexdigest() for (s, _), b in zip(runs, images)}
        self.stats["images"] += len(images)

    def generate(self, input_ids: list[int], params: SamplingParams | None = None, trajectory_id: str = "",
                 max_stale_versions: int | None = None, timeout: float | None = 60.0) -> GenerateOutput:
        """Blocking convenience around submit(); cancels the request if the timeout passes."""
        fut = self.submit(input_ids, params, trajectory_id, max_stale_versions)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    # ---- weights -------------------------------------------------------------------------------------
    def update_weights(self, version: int, path: str | None = None, state_dict: dict | None = None,
                       timeout: float | None = 120.0, wait: bool = True):
        """Install new weights between two scheduler steps and return {version, load_ms, interrupted_requests, ...}.

        Reading and checking the weights happens in the calling thread so decoding goes on meanwhile. With
        wait=False the Future of that info is returned (safe to call from an on_token callback).
        Raises ValueError when version is not newer, WeightsRefused when it jumps past cfg.max_version_jump or a
        weight is not finite, WeightLoadError when the weights do not fit; the weights served stay in every case.
        """
        t0 = time.monotonic()
        version = int(version)
        # One update reads and checks its weights at a time; the next waits at most its own deadline, and one that
        # gives up is never installed (UpdateBusy), rather than landing after its caller was told it failed.
        if not self._update_lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise UpdateBusy(f"version {version} not installed: another weight update held the engine for {timeout}s")
        try:
            check_version_step(self._target_version, version, self.cfg.max_version_jump)
            if state_dict is None:
                if not path:
                    raise WeightLoadError("update_weights needs a path or a state_dict")
                state_dict = load_state_dict(path)
            self._check_weights(state_dict)
            upd = WeightUpdate(version, state_dict, Future(), t0)
            self._queue.put_update(upd)  # EngineClosed
            self._target_version = version
        finally:
            self._update_lock.release()
        if self._thread is None:  # not started (tests): apply inline so the caller is not stuck
            self._sched.apply_pending()
        if not wait:
            return upd.future
        return upd.future.result(timeout)

    def _check_weights(self, sd: dict) -> None:
        from core.model import canonical_names

        sd = {k: v for k, v in canonical_names(sd).items()
              if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)}
        missing = sorted(set(self._shapes) - set(sd))
        unexpected = sorted(set(sd) - set(self._shapes))
        if missing or unexpected:
            raise WeightLoadError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        wrong = [(k, tuple(v.shape), self._shapes[k]) for k, v in sd.items() if tuple(v.shape) != self._shapes[k]]
        if wrong:
            raise WeightLoadError(f"weight shapes do not match the model, e.g. {wrong[0][0]}: {wrong[0][1]} vs {wrong[0][2]}")
        check_finite(sd, self.dtype)

    # ---- metrics -------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        s = self.stats
        elapsed = max(time.monotonic() - self.started, 1e-9)
        steps = s["decode_steps"]
        prompt = s["cache_hit_tokens"] + s["prefill_tokens"]
        return {
            "engine": self.name,
            "version": self.version,
            "requests": s["requests"],
            "requests_finished": s["finished"],
            "requests_cancelled": s["cancelled"],
            "requests_rejected_queue_full": s["rejected_queue_full"],
            "waiting": self._queue.waiting,
            "running": self._sched.active(),
            "tokens_generated": s["tokens"],
            "tokens_per_s": s["tokens"] / elapsed,
            "decode_steps": steps,
            "batch_mean": s["batch_rows"] / steps if steps else 0.0,
            "batch_hist": {k: self.batch_hist[k] for k in sorted(self.batch_hist, key=lambda x: int(x.split("-")[0]))},
            "prefill_steps": s["prefill_steps"],
            "prefill_tokens": s["prefill_tokens"],
            "cache_hit_tokens": s["cache_hit_tokens"],
            "cache_hit_share": s["cache_hit_tokens"] / prompt if prompt else 0.0,
            "cache_entries": len(self._sched.cache),
            "cache_bytes": self._sched.cache.nbytes,
            "cache_max_bytes": self._sched.cache.max_bytes,
            "cache_blocks": self._sched.cache.blocks,
            "cache_evicted_blocks": self._sched.cache.evicted_blocks,
            "cache_evicted_entries": self._sched.cache.evicted_entries,
            "cache_dropped_stale": self._sched.cache.dropped_stale,
            "weight_updates": s["weight_updates"],
            "interrupted_requests": s["interrupted"],
            "recomputed_tokens": s["recomputed_tokens"],
            "stale_kv_kept": s["stale_kept"],
            "idle_share": self._sched.idle_s / elapsed,
            "step_errors": s["step_errors"],
        }


def load_state_dict(path: str) -> dict:
    """An HF directory (model.safetensors, or shards + model.safetensors.index.json) or a .safetensors file -> state
    dict; WeightLoadError if unreadable."""
    import pathlib

    from safetensors.torch import load_file

    from core.model import read_weights

    p = pathlib.Path(path)
    is_dir = p.is_dir()  # OSError (a name too long to look at) goes to the caller, as before
    try:
        return read_weights(p) if is_dir else load_file(str(p))
    except Exception as e:  # missing file, truncated write, not safetensors: all mean "cannot load"
        raise WeightLoadError(f"cannot load weights from {p}: {type(e).__name__}: {e}") from e


def _check_loaded(model: CausalLM, path: str, dtype: torch.dtype) -> None:
    """A checkpoint whose weights are, or became once cast to the serving dtype, NaN or inf is refused at start (one
    line, exit 2 from `tars serve`): served, it sampled from NaN logits, and every weight update of the same shape
    was refused by check_finite, so training went on while the servers kept the start's weights."""
    bad = next((k for k, v in model.hf_state_dict().items() if not finite(v)), None)
    if bad is not None:
        over = (f" (values beyond {dtype}'s range, +-{torch.finfo(dtype).max:g}, overflow to inf in it: serve in "
                "bfloat16 or float32)") if dtype.is_floating_point and torch.finfo(dtype).max < 1e6 else ""
        raise UserError(f"{path}: weight {bad} holds NaN or inf as inference.precision {dtype}{over}")
