"""What an inference server process runs and where it may listen: the engine `inference.engine` names
(make_engine) and the bind check of its listener (check_bind); inference_server/server.py serves them."""
from __future__ import annotations

from core import auth
from core.config import InferenceConfig
from inference_server.engine import LocalEngine


def check_bind(cfg: InferenceConfig, control_token: str | None) -> None:
    """core.auth.check_listener for this server (InsecureBind off loopback without its tokens)."""
    control = cfg.auth_token if control_token is None else control_token
    auth.check_listener("inference", "the InferenceService (UpdateWeights included) and its ControlService", cfg.host,
                        {"inference.auth_token": cfg.auth_token, "control.auth_token": control})


def make_engine(cfg: InferenceConfig, model_path: str, version: int = 0):
    """The engine cfg.engine names: `local` (LocalEngine over model_path) or `sglang` (SGLangEngine over the servers it
    launches on model_path, cfg.sglang_launch, or over cfg.sglang_urls; model_path's config.json supplies the
    vocabulary size for validation)."""
    if cfg.engine == "local":
        return LocalEngine(cfg, model_path, version)
    if cfg.engine == "sglang":
        import json
        import pathlib

        from inference_server.sglang_start import open_sglang_engine

        conf = pathlib.Path(model_path or ".") / "config.json"
        vocab = json.loads(conf.read_text()).get("vocab_size") if model_path and conf.is_file() else None
        return open_sglang_engine(cfg, model_path, version, vocab)  # launched or attached; waits for a first replica
    raise ValueError(f"engine {cfg.engine!r} is not available in this server; use engine=local or engine=sglang")
