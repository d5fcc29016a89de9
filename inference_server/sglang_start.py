"""Starting the `sglang` engine (`open_sglang_engine`, what make_engine calls): either launch cfg.sglang_launch servers
on the checkpoint directory and supervise them (inference_server.sglang_launch.SGLangFleet: `python -m
sglang.launch_server --model-path M --tokenizer-path M --skip-tokenizer-init --host H --port P --weight-version V`, one
GPU each through CUDA_VISIBLE_DEVICES, own process group, PDEATHSIG, restarted when one dies), or attach to
cfg.sglang_urls. Either way the start waits (cfg.sglang_startup_timeout_s) until a first server answers
/health_generate; the others start out of rotation until the health thread lets them in. The tests run the same code
with the conformance server as the module.
"""
from __future__ import annotations

from core.config import InferenceConfig
from inference_server.sglang_engine import SGLangEngine


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
    engine = SGLangEngine(cfg, urls, version, vocab_size=vocab_size, health_thread=False)
    for rep in engine.replicas:  # still loading: out of rotation until the health thread lets it in
        if rep.url not in healthy:
            engine.pool.mark_down(rep, "not answering /health_generate yet")
    if fleet is not None:
        engine.fleet = fleet
        fleet.on_exit = lambda i, code: engine.pool.mark_down(engine.replicas[i], f"server exited with status {code}")
    engine.pool.start_health_thread()
    return engine

