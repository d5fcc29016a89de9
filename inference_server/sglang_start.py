"""Starting the `sglang` engine (`open_sglang_engine`, what make_engine calls): either launch cfg.sglang_launch servers
on the checkpoint directory and supervise them (inference_server.sglang_launch.SGLangFleet: `python -m
sglang.launch_server --model-path M --tokenizer-path M --skip-tokenizer-init --host H --port P --weight-version V`, one
GPU each through CUDA_VISIBLE_DEVICES, own process group, PDEATHSIG, restarted when one dies), or attach to
cfg.sglang_urls. Either way the start waits (cfg.sglang_startup_timeout_s) until a first server answers
/health_generate; the others start out of rotation until the health thread lets them in. The tests run the same code
with the conformance server as the module. The servers' context length (GET /v1/models, max_model_len) bounds
inference.max_context (fit_context); launched servers get `--context-length` inference.max_context
(inference.sglang_launch.context_args).
"""
from __future__ import annotations

import logging

from core.config import InferenceConfig
from inference_server.sglang_engine import SGLangEngine
from inference_server.sglang_http import http_json

log = logging.getLogger("tars.inference.sglang")


def server_context(url: str, timeout: float = 10.0) -> int | None:
    """An SGLang server's context length: GET /v1/models -> data[].max_model_len (its model_config.context_len, what
    the tokenizer manager checks requests against); None when it does not say."""
    try:
        status, resp = http_json(url, "/v1/models", timeout=timeout)
    except OSError:
        return None
    data = resp.get("data") if status == 200 and isinstance(resp, dict) else None
    lens = [m["max_model_len"] for m in data or () if isinstance(m, dict) and type(m.get("max_model_len")) is int]
    return min(lens) if lens else None


def fit_context(cfg: InferenceConfig, urls: list[str]) -> None:
    """Make inference.max_context (the C that request_limit() takes SGLang's context length to be) no larger than the
    context length of any server in `urls`: lowered in place (the front shares this config), with a warning; a server
    with a longer context is only warned about (tars's limit is the stricter one)."""
    ctx = {u: c for u in urls if (c := server_context(u, cfg.sglang_health_timeout_s)) is not None}
    if any(c != cfg.max_context for c in ctx.values()):
        before = cfg.max_context
        cfg.max_context = min(before, *ctx.values())
        log.warning("SGLang context length %s differs from inference.max_context=%d: requests are limited to prompt + "
                    "max_new_tokens <= %d", ctx, before, cfg.request_limit())


def open_sglang_engine(cfg: InferenceConfig, model_path: str = "", version: int = 0, vocab_size: int | None = None) -> SGLangEngine:
    """The `sglang` engine as cfg says: launch and supervise cfg.sglang_launch servers on model_path, or attach to
    cfg.sglang_urls; returns once a first server answers /health_generate (SGLangStartupError, one line, when none
    does within cfg.sglang_startup_timeout_s or a launched one exits first; the launched ones are stopped then)."""
    from inference_server.sglang_launch import SGLangFleet, wait_first_healthy

    if cfg.sglang_launch and cfg.sglang_urls:
        raise ValueError("engine=sglang: set inference.sglang_launch (start servers) or inference.sglang_urls (attach to "
                         "running ones), not both")
    if cfg.sglang_launch < 0:
        raise ValueError(f"inference.sglang_launch must be >= 0, got {cfg.sglang_launch}")
    if not cfg.sglang_launch and not cfg.sglang_urls:
        raise ValueError("engine=sglang needs inference.sglang_urls (base URLs of running SGLang servers) or "
                         "inference.sglang_launch (how many to start on the model directory)")
    fleet = None
    if cfg.sglang_launch:
        if not model_path:
            raise ValueError("inference.sglang_launch needs the model directory (--model)")
        fleet = SGLangFleet(cfg, model_path, version)
        fleet.start()
        try:
            healthy = fleet.wait_first_healthy(cfg.sglang_startup_timeout_s)
        except BaseException:
            fleet.stop()
            raise
        urls = fleet.urls
    else:
        urls = [str(u).rstrip("/") for u in cfg.sglang_urls]
        healthy = wait_first_healthy(urls, cfg.sglang_startup_timeout_s)
    fit_context(cfg, healthy)
    engine = SGLangEngine(cfg, urls, version, vocab_size=vocab_size, health_thread=False)
    for rep in engine.replicas:  # still loading: out of rotation until the health thread lets it in
        if rep.url not in healthy:
            engine.pool.mark_down(rep, "not answering /health_generate yet")
    if fleet is not None:
        engine.fleet = fleet
        fleet.on_exit = lambda i, code: engine.pool.mark_down(engine.replicas[i], f"server exited with status {code}")
    engine.pool.start_health_thread()
    return engine

