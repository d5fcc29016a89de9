"""Pruning the published weights directory (learner/publish.py prune): the newest learner.publish.keep_versions
whole versions stay, counted numerically; the temporary directories of saves a killed learner interrupted
(vN.tmpPID, vN.oldPID) are removed and never counted as versions; another live process's save in progress stays."""
from __future__ import annotations

import collections
import pathlib
import subprocess
import sys

from core.config_learner import PublishConfig
from core.model_config import DecoderConfig
from learner.policy import TrainPolicy
from learner.publish import Publisher, publish_weights


def tiny() -> TrainPolicy:
    return TrainPolicy.from_config(DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2), seed=0)


def _dead_pid() -> int:
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, timeout=60)
    return int(out.stdout)


def _names(w: pathlib.Path) -> set[str]:
    return {d.name for d in w.iterdir()}


def test_leftovers_of_dead_saves_are_removed_and_never_counted(tmp_path):
    policy, w = tiny(), tmp_path / "weights"
    for v in (1, 2):
        publish_weights(policy, w, v, [], keep=2)
    dead = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        for name in (f"v000003.tmp{dead}", f"v000002.old{dead}", f"v000005.tmp{live.pid}"):
            (w / name).mkdir()
            (w / name / "model.safetensors").write_bytes(b"half a file")
        publish_weights(policy, w, 4, [], keep=2)
        # v2 is one of the 2 newest whole versions; the dead saves' leftovers are gone; the live one's save stays
        assert _names(w) == {"v000002", "v000004", f"v000005.tmp{live.pid}"}
        assert (w / "v000002" / "config.json").is_file()
    finally:
        live.stdin.close()
        live.wait(60)
    # once its process is gone, the next publish removes it
    publish_weights(policy, w, 5, [], keep=2)
    assert _names(w) == {"v000004", "v000005"}


def test_versions_are_counted_numerically_and_a_starting_learner_cleans_up(tmp_path):
    policy, w = tiny(), tmp_path / "run" / "weights"
    w.mkdir(parents=True)
    for name in ("v999999", "v1000000"):  # v1000000 sorts before v999999 as text
        (w / name).mkdir()
    dead = _dead_pid()
    (w / f"v1000001.tmp{dead}").mkdir()
    Publisher(policy, tmp_path / "run", [], "", PublishConfig(mode="disk", keep_versions=2), collections.Counter())
    assert _names(w) == {"v999999", "v1000000"}  # the leftover removed at start, the versions kept
    publish_weights(policy, w, 1000001, [], keep=2)
    assert _names(w) == {"v1000000", "v1000001"}
