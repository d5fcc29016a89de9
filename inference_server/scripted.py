"""The `scripted` engine: answers every request with tokens chosen by a function, at no model cost.

It sits behind the real InferenceService (same gRPC front, same client, same deadlines), so what it measures or
tests is everything but the model: the actor's own overhead (tars bench actor), and deterministic plumbing such as an
LLM judge's verdict parsing (actor/judge.py). Each output token gets logprob -0.1 and the engine's current version;
update_weights only bumps the version (it has no weights), which is enough to tag tokens of two policy versions.

    python -m inference_server.scripted --tokenizer MODEL_DIR --answer "wait()" --ready-file r.json
                                                                                 # a server on 127.0.0.1:<free port>
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

from inference_server.engine_types import STOP, EngineClosed, GenerateOutput, SamplingParams

# respond(input_ids, images) -> output token ids (the stop token included if the answer should end with one).
Respond = Callable[[list[int], Sequence], list[int]]


class ScriptedEngine:
    accepts_images = True
    def __init__(self, respond: Respond, vocab_size: int, version: int = 0, name: str = "scripted"):
        self.respond, self.vocab_size, self.version, self.name = respond, vocab_size, int(version), name
        self.stats = collections.Counter()
        self.last_images: list = []          # images of the latest request (tests check what arrived)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, input_ids: list[int], params: SamplingParams | None = None, trajectory_id: str = "",
               max_stale_versions: int | None = None, on_token=None, images: Sequence = ()) -> Future:
        params = params or SamplingParams()
        if self._closed:
            raise EngineClosed("engine closed")
        if not input_ids:
            raise ValueError("input_ids is empty")
        if params.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {params.max_new_tokens}")
        bad = next((t for t in input_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"input_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})")
        out = [int(t) for t in self.respond(list(input_ids), list(images))][: params.max_new_tokens]
        with self._lock:
            v = self.version
            self.stats["requests"] += 1
            self.stats["tokens"] += len(out)
            self.stats["images"] += len(images)
            self.last_images = list(images)
        if on_token is not None:
            for t in out:
                on_token(t, -0.1, v)
        fut: Future = Future()
        stop = set(params.stop_token_ids)
        reason = STOP if out and out[-1] in stop else "length"
        fut.set_result(GenerateOutput(out, [-0.1] * len(out), [v] * len(out), reason, len(input_ids), 0, 0, 0))
        return fut

    def update_weights(self, version: int, path=None, state_dict=None, timeout=None, wait=True):
        with self._lock:
            if int(version) <= self.version:
                raise ValueError(f"version {version} is not newer than the current version {self.version}")
            self.version = int(version)
        return {"version": self.version, "load_ms": 0.0, "interrupted_requests": 0}

    def metrics(self) -> dict:
        return {"engine": self.name, "version": self.version, **self.stats}

    def close(self, timeout: float = 10.0) -> None:
        self._closed = True


def fixed_answer(ids: list[int]) -> Respond:
    return lambda _input, _images: ids


async def _serve(answer: str, tokenizer: str, ready_file: str | None, stop: asyncio.Event | None = None) -> None:
    from inference_server.server import InferenceServer
    from core.config import InferenceConfig
    from core.proc import write_ready
    from core.chat import ChatTokenizer

    tok = ChatTokenizer.load(tokenizer)
    eng = ScriptedEngine(fixed_answer(tok.answer(answer)), tok.vocab_size)
    srv = InferenceServer(InferenceConfig(host="127.0.0.1", port=0), eng, model_name="scripted")
    await srv.start()
    write_ready(ready_file, {"role": "inference", "address": srv.address, "version": 0, "t": time.time()})
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await srv.stop(1.0)


def main(argv: list[str] | None = None) -> int:
    from core.proc import die_with_parent

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answer", default="wait()", help="text every generation returns (then the stop token)")
    ap.add_argument("--tokenizer", required=True, help="directory of the tokenizer the answers are written in")
    ap.add_argument("--ready-file")
    a = ap.parse_args(argv)
    die_with_parent()
    asyncio.run(_serve(a.answer, a.tokenizer, a.ready_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
