"""Weight publishing: each new policy version goes to disk in HF layout and to every inference server.

weights/v{version} is written to a temporary name and renamed (a server never loads half a version), every server is
told to load it (UpdateWeights), and all but the last `learner.publish.keep_versions` versions are pruned. Each
version carries the starting model directory's tokenizer files (core.chat.copy_tokenizer_files), so it is a model
directory of its own, as is the final export.
"""
from __future__ import annotations

import collections
import logging
import pathlib
import shutil
import time

from core import rpc
from core.config_learner import PublishConfig
from core.v1 import inference_pb2, inference_pb2_grpc
from learner.policy import TrainPolicy

log = logging.getLogger("tars.learner")

MAX_MESSAGE_BYTES = 512 << 20  # UpdateWeights may carry inline weights


def publish_weights(policy: TrainPolicy, wdir: pathlib.Path, version: int, stubs, keep: int, counters=None,
                    timeout_s: float = 60.0, tokenizer_from: pathlib.Path | None = None) -> float:
    """weights/v{version} in HF layout (write, then rename), every server told to load it, old versions pruned.

    Returns the seconds from the start of the write until the last server answered (it serves the new weights then).
    """
    t0 = time.perf_counter()
    wdir.mkdir(exist_ok=True)
    path = wdir / f"v{version:06d}"
    policy.save_hf(path, tokenizer_from=tokenizer_from)
    for stub in stubs:
        try:
            stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=version, path=str(path)), timeout=timeout_s)
        except Exception as e:  # a dead replica must not stop training; it reloads the latest on restart
            if counters is not None:
                counters["publish_failures"] += 1
            log.warning("publish v%d failed: %s", version, e)
    for old in sorted(wdir.glob("v*"))[: -max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return time.perf_counter() - t0


class Publisher:
    """The learner's publisher: its policy, run_dir/weights and one stub per inference server."""

    def __init__(self, policy: TrainPolicy, run: pathlib.Path, inference: list[str], auth_token: str, cfg: PublishConfig,
                 counters: collections.Counter, tokenizer_from: pathlib.Path | None = None):
        self.policy, self.wdir, self.cfg, self.counters = policy, run / "weights", cfg, counters
        self.tokenizer_from = tokenizer_from
        self.stubs = [inference_pb2_grpc.InferenceServiceStub(rpc.sync_channel(a, auth_token, MAX_MESSAGE_BYTES))
                      for a in inference]

    def publish(self, version: int) -> float:
        """Write weights/v{version} atomically and tell every inference server to load it; seconds taken."""
        if version == 0:
            return 0.0  # the servers started from model_dir at version 0
        return publish_weights(self.policy, self.wdir, version, self.stubs, self.cfg.keep_versions, self.counters,
                               self.cfg.timeout_s, self.tokenizer_from)


def export(policy: TrainPolicy, model_dir: pathlib.Path, path: pathlib.Path) -> None:
    """The final policy in HF layout with the tokenizer files of the starting model: a model directory of its own."""
    policy.save_hf(path, tokenizer_from=model_dir)
