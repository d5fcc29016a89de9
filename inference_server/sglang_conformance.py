"""A stand-in SGLang server: SGLang 0.5.23's native HTTP API *behaviour* over a LocalEngine (standard library only).

What it reproduces (checked against SGLang's http_server.py, tokenizer_manager.py, io_struct.py, weight_versions.py):
- POST /generate {rid, input_ids, sampling_params, return_logprob, logprob_start_len, stream}: {output_ids,
  meta_info{id, finish_reason, prompt_tokens, completion_tokens, cached_tokens, weight_version, weight_versions,
  output_token_logprobs [[lp, id, None]]}}. finish_reason is {"type": "stop", "matched": id} | {"type": "length",
  "length": n} | {"type": "abort", "message", "status_code", "err_type"}; an aborted request answers 200 with its
  partial output. EOS stops generation unless sampling_params.ignore_eos; top_k -1 = off (0 is rejected); temperature
  0 = greedy. weight_versions are run-length spans {version, start, end} (end exclusive) over the output tokens.
- POST /abort_request {rid | abort_all}: the scheduler aborts every request whose rid STARTS WITH the given rid. With
  one tokenizer worker (SGLang's default) the tokenizer manager first drops the abort unless the rid itself is in
  flight; `tokenizer_workers > 1` skips that guard, as SGLang does.
- POST /pause_generation {mode}: abort (in-flight requests end with finish abort), retract (requests leave the
  engine, keep their tokens and are re-prefilled after /continue_generation, under whatever weights are loaded
  then), in_place (the engine freezes; requests keep their KV and continue after /continue_generation). While
  paused, new /generate calls wait.
- POST /update_weights_from_disk {model_path, weight_version, abort_all_requests, flush_cache=true}:
  {success, message, num_paused_requests}. Not paused: waits until no request is in flight (SGLang's writer lock)
  and holds new ones back; paused: applies at once (in_place: at the next step boundary, after continue).
- Where the `sglang` package is importable, every body is also checked against SGLang's own request types
  (inference_server.sglang_types) and refused with 400 and SGLang's message when they refuse it.
- GET|POST /flush_cache (400 while requests are in flight), GET /get_model_info (alias /model_info),
  /get_weight_version, /get_server_info, /health, /health_generate (a 1-token generation; 503 if none within
  `health_timeout_s`, e.g. while paused).
Not reproduced: text prompts / `stop` strings (token-in-token-out only, as with --skip-tokenizer-init), prompt
logprobs (logprob_start_len must be -1), images, batch requests, the radix cache's content addressing (prefix hits
come from LocalEngine's per-key cache keyed by the first 16 prompt tokens, so multi-turn prompts hit).

    python -m inference_server.sglang_conformance --model DIR --port N --host 127.0.0.1
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from inference_server.engine import LENGTH, STOP, LocalEngine, SamplingParams, WeightLoadError
from inference_server.sglang_types import SGLangTypes
from core.config import InferenceConfig

CACHE_KEY_TOKENS = 16
_KEEP_KV = 1 << 30  # in_place pauses keep KV across any number of versions; flushes are done by cache-key epochs


class _Req:
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


class ConformanceServer:
    """In-process SGLang stand-in; start() binds (port 0 = free) and returns the port; stop() shuts it down."""

    def __init__(self, model: str, host: str = "127.0.0.1", port: int = 0, weight_version: str = "default",
                 cfg: InferenceConfig | None = None, tokenizer_workers: int = 1, health_timeout_s: float = 20.0,
                 token_delay_s: float = 0.0, sglang_types: SGLangTypes | None = None):
        # token_delay_s: sleep after every token (a slower accelerator), so tests can act while requests run.
        # sglang_types: checks against the `sglang` package's request types (default: active when importable).
        self.types = sglang_types if sglang_types is not None else SGLangTypes.load()
        self.model_path = model
        self.cfg = cfg or InferenceConfig(max_context=1024, max_stale_versions=_KEEP_KV)
        self.engine = LocalEngine(self.cfg, model)
        self.eos = self.engine.model.config.eos_token_id
        self.host, self.port = host, port
        self.tokenizer_workers = tokenizer_workers
        self.health_timeout_s = health_timeout_s
        self.token_delay_s = token_delay_s
        self.vstr = {self.engine.version: str(weight_version)}  # engine int version -> SGLang weight_version string
        self.weight_version = str(weight_version)
        self.epoch = 0                     # prefix-cache generation; a flush starts a new one
        self.cv = threading.Condition()
        self.reqs: dict[str, _Req] = {}    # in flight
        self.paused: str | None = None     # None | abort | retract | in_place
        self.updating = False              # an unpaused weight update holds the writer lock
        self.closed = False
        self.httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> int:
        srv = self

        class Handler(_Handler):
            server_ref = srv

        self.httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        with self.cv:
            self.closed = True
            self.paused = None
            self.cv.notify_all()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        self.engine.close()

    # ---- generation ----------------------------------------------------------------------------------
    def _wait_admitted(self) -> None:
        while self.paused is not None or self.updating:
            if self.closed:
                raise RuntimeError("server closed")
            self.cv.wait(0.2)

    def generate(self, body: dict) -> _Req:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("input_ids must be a non-empty list of token ids (this server has no tokenizer)")
        if body.get("logprob_start_len", -1) not in (-1, None):
            raise ValueError("only logprob_start_len=-1 (output logprobs) is supported")
        sp = body.get("sampling_params") or {}
        top_k = int(sp.get("top_k", -1))
        if top_k < -1 or top_k == 0:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
        top_p = float(sp.get("top_p", 1.0))
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        stops = set(int(t) for t in sp.get("stop_token_ids") or ())
        if not sp.get("ignore_eos", False):
            stops.add(self.eos)
        params = SamplingParams(max_new_tokens=int(sp.get("max_new_tokens", 128)), temperature=float(sp.get("temperature", 1.0)),
                                top_p=top_p, top_k=max(top_k, 0), stop_token_ids=tuple(sorted(stops)), seed=int(sp.get("sampling_seed") or 0))
        self.engine.validate(ids, params)
        rid = str(body.get("rid") or uuid.uuid4().hex)
        with self.cv:
            self._wait_admitted()
            if rid in self.reqs:
                raise ValueError(f"Duplicate request ID: {rid}")
            r = _Req(rid, ids, params)
            r.return_logprob = bool(body.get("return_logprob"))
            self.reqs[rid] = r
            self._submit(r)
        return r

    def _submit(self, r: _Req) -> None:
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
                reason = {"type": "stop", "matched": r.out[-1]} if out.finish_reason == STOP else {"type": "length", "length": len(r.out)}
                assert out.finish_reason in (STOP, LENGTH)
                self._finish(r, reason)

        r.future = self.engine.submit(ids, p, key, _KEEP_KV, on_token)
        r.future.add_done_callback(done)

    def _finish(self, r: _Req, reason: dict) -> None:
        r.finish = reason
        self.reqs.pop(r.rid, None)
        r.done.set()
        self.cv.notify_all()

    def _abort(self, r: _Req, message: str = "Abort in waiting queue") -> None:
        """With self.cv held: end r now with its partial output."""
        r.segment += 1
        if r.future is not None:
            r.future.cancel()
        self._finish(r, {"type": "abort", "message": message, "status_code": None, "err_type": None})

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

    def response(self, r: _Req, final: bool = True) -> dict:
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
                for r in self.reqs.values():
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

    def update_weights(self, body: dict) -> tuple[bool, str, int]:
        path = body.get("model_path") or ""
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
            version = self.engine._target_version + 1
            try:
                # in_place: the engine thread may be parked in on_token, so the update lands when it resumes.
                fut = self.engine.update_weights(version, path, None, self.cfg.update_timeout_s, wait=paused not in ("in_place",))
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
        try:
            f = self.engine.submit([0], SamplingParams(max_new_tokens=1, temperature=0.0))
            f.result(max(0.01, deadline - time.monotonic()))
            return True
        except Exception:
            return False

    def tokens_in_flight(self) -> int:
        with self.cv:
            return sum(len(r.out) for r in self.reqs.values())

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version}


class _Handler(BaseHTTPRequestHandler):
    server_ref: ConformanceServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: the launcher prints nothing
        pass

    def _send(self, code: int, obj=None, text: str | None = None) -> None:
        data = (text if text is not None else json.dumps(obj)).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain" if text is not None else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        body = json.loads(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

    def _error(self, code: int, msg: str) -> None:
        self._send(code, {"object": "error", "message": msg, "type": "BadRequestError" if code < 500 else "InternalServerError", "param": None, "code": code})

    def do_GET(self) -> None:
        s, path = self.server_ref, self.path.split("?")[0]
        if path in ("/health", "/health_generate"):
            self._send(200 if s.health_generate() else 503, text="")
        elif path in ("/get_model_info", "/model_info"):
            self._send(200, s.model_info())
        elif path == "/get_weight_version":
            self._send(200, {"weight_version": s.weight_version})
        elif path == "/get_server_info":
            m = s.engine.metrics()
            self._send(200, {"model_path": s.model_path, "weight_version": s.weight_version, "version": "0.5.23-conformance",
                             "skip_tokenizer_init": True, "internal_states": [{"paused": s.paused, "running": m["running"], "waiting": m["waiting"]}]})
        elif path == "/flush_cache":
            self._flush()
        else:
            self._error(404, f"Not Found: {path}")

    def _flush(self) -> None:
        ok = self.server_ref.flush_cache()
        self._send(200 if ok else 400, text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n")

    def do_POST(self) -> None:
        s, path = self.server_ref, self.path.split("?")[0]
        try:
            body = self._body()
        except (ValueError, UnicodeDecodeError) as e:
            return self._error(400, f"bad JSON: {e}")
        try:
            s.types.check(path, body, s.engine.vocab_size)
            if path in ("/generate",):
                return self._generate(body)
            if path == "/abort_request":
                s.abort_request(str(body.get("rid") or ""), bool(body.get("abort_all")))
                return self._send(200, text="")
            if path == "/pause_generation":
                s.pause(body.get("mode", "abort"))
                return self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
            if path == "/continue_generation":
                s.resume()
                return self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
            if path == "/update_weights_from_disk":
                ok, msg, n = s.update_weights(body)
                return self._send(200 if ok else 400, {"success": ok, "message": msg, "num_paused_requests": n})
            if path == "/flush_cache":
                return self._flush()
            self._error(404, f"Not Found: {path}")
        except ValueError as e:
            self._error(400, str(e))
        except Exception as e:  # closed while waiting, engine failure: a 5xx, as a crashed SGLang would answer
            self._error(503, f"{type(e).__name__}: {e}")

    def _generate(self, body: dict) -> None:
        s = self.server_ref
        r = s.generate(body)
        if not body.get("stream"):
            while not r.done.wait(0.5):
                if s.closed:
                    return self._error(503, "server closed")
            return self._send(200, s.response(r))
        # Server-sent events, each chunk cumulative (SGLang's default, non-incremental streaming), then [DONE].
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        sent = 0
        while True:
            finished = r.done.wait(0.02)
            with s.cv:
                n = len(r.out)
                chunk = s.response(r, final=finished) if finished or n > sent else None
            if chunk is not None:
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
                sent = n
            if finished or s.closed:
                break
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="SGLang native-API stand-in over the local engine")
    ap.add_argument("--model", "--model-path", dest="model", required=True, help="HF-layout directory (config.json + model.safetensors)")
    ap.add_argument("--skip-tokenizer-init", action="store_true", help="accepted for sglang.launch_server parity (always token ids)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--weight-version", default="default", help="initial weight_version string")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--tokenizer-workers", type=int, default=1, help=">1 drops the exact-rid guard of /abort_request")
    a = ap.parse_args(argv)
    from core.proc import die_with_parent

    die_with_parent()
    srv = ConformanceServer(a.model, a.host, a.port, a.weight_version, InferenceConfig(max_context=a.max_context, max_stale_versions=_KEEP_KV),
                            tokenizer_workers=a.tokenizer_workers)
    srv.start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
