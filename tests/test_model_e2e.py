"""A Hugging Face checkpoint directory end to end, on CPU: tiny random Qwen2, Llama and Qwen3 checkpoints (transformers' own
classes, sharded safetensors, a byte-level BPE tokenizer with the ChatML / Llama-3 chat template) through `tars serve`,
the actor's episodes, the learner's model class, `tars sft`, `tars eval` and a short `tars up`."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from hf_dirs import make_checkpoint

ROOT = pathlib.Path(__file__).resolve().parent.parent


# qwen3 in the slow set: its numbers against transformers (q_norm / k_norm, the KV cache) are tests/test_model_hf.py's,
# and its chat template is qwen2's ChatML
@pytest.fixture(scope="module", params=["qwen2", "llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def ckpt(request, tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp(request.param) / "ckpt"
    make_checkpoint(d, request.param)
    return d


def _cli(*args, timeout=240) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "tars.cli", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_the_checkpoint_is_sharded_and_has_a_chat_template(ckpt):
    assert (ckpt / "model.safetensors.index.json").is_file() and not (ckpt / "model.safetensors").exists()
    assert len(list(ckpt.glob("model-*-of-*.safetensors"))) >= 2
    from core.chat import open_tokenizer

    tok = open_tokenizer(ckpt, ckpt)
    assert tok.hf.chat_template and tok.eot_id in tok.stop_ids


def test_learner_logprobs_equal_the_engines_over_multi_turn_episodes(ckpt, tmp_path):
    """Episodes through a real `tars serve` and `tars envd`; then the learner's model class (transformers) recomputes
    the logprob of every sampled token on the trajectory's own ids: each matches the engine's within 1e-4 (fp32)."""
    from core import config as C
    from learner.policy import TrainPolicy
    from tests.served import topology_episodes

    cfg = C.load(None, None, ["actor.max_turns=3", "actor.max_new_tokens=10", "actor.temperature=1.0",
                              "actor.on_parse_error=continue"])
    trs = topology_episodes(cfg, tmp_path / "out", ckpt, "builtin/mixed", 4, "lp")
    assert all(t.outcome != "infra_error" for t in trs), [t.error for t in trs]
    assert sum(len(t.turns) for t in trs) > len(trs)          # multi-turn: later turns were appended
    policy = TrainPolicy.load(ckpt).eval()
    worst, n = 0.0, 0
    for tr in trs:
        ids = torch.as_tensor(tr.tokens.astype(np.int64))[None]
        mask = torch.as_tensor(tr.mask.astype(np.int64))[None]
        with torch.no_grad():
            lp = policy.logprobs_at(ids, torch.ones_like(ids, dtype=torch.bool), mask).numpy()
        behaviour = tr.logprobs[tr.mask.astype(bool)]
        assert lp.shape == behaviour.shape
        worst, n = max(worst, float(np.abs(lp - behaviour).max())), n + len(lp)
        # the ids are the engine's: each turn's output sits where the trajectory says
        for t in tr.turns:
            assert tr.mask[t.start:t.end].all() and (tr.versions[t.start:t.end] == 0).all()
    print(f"{ckpt}: {n} sampled tokens, max |learner - engine| logprob {worst:.2e}")
    assert n > 20 and worst <= 1e-4


def test_sft_eval_and_a_short_up_run_on_the_checkpoint(ckpt, tmp_path):
    _cli("sft", "--model", str(ckpt), "--out", str(tmp_path / "sft"), "--demos", "40", "--steps", "4",
         "--set", "sft.batch_size=4")
    sft = tmp_path / "sft"
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(sft)             # the output is a checkpoint directory
    assert transformers.AutoTokenizer.from_pretrained(sft).chat_template  # with the tokenizer and its template
    _cli("eval", "--suite", "builtin", "--model", str(sft), "--out", str(tmp_path / "eval"), "--episodes", "1",
         "--tasks", "builtin/click", "--concurrency", "2", "--set", "actor.max_new_tokens=8")
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert res["overall"]["episodes"] == 1 and res["overall"]["infra_errors"] == 0
    out = tmp_path / "up"
    _cli("up", "--out", str(out), "--quiet", "--set", f"model.path={ckpt}", "--set", "sft.steps=0",
         "--set", "learner.batch_size=8", "--set", "actor.concurrency=8", "--set", "actor.max_new_tokens=8",
         "--set", "actor.max_turns=2", "--set", "learner.algo=grpo", "--set", "learner.group.size=2",
         "--set", "max_versions=2", "--set", "wall_budget_s=90")
    rep = json.loads((out / "report.json").read_text())
    assert rep["policy_version"] >= 2, rep
    final = out / "final"
    transformers.AutoModelForCausalLM.from_pretrained(final)
    assert transformers.AutoTokenizer.from_pretrained(final).chat_template
    model_type = json.loads((ckpt / "config.json").read_text())["model_type"]
    assert json.loads((final / "config.json").read_text())["model_type"] == model_type


def _fails(*args) -> str:
    r = subprocess.run([sys.executable, "-m", "tars.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.stderr


def test_unusable_checkpoints_are_one_clear_error_from_every_command(tmp_path):
    import shutil

    from hf_dirs import make_hf_model

    # another architecture
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                  "vocab_size": 300, "n_embd": 32}))
    assert "is not supported" in _fails("serve", "--model", str(gpt2))
    assert "is not supported" in _fails("up", "--out", str(tmp_path / "u1"), "--set", f"model.path={gpt2}")
    # a checkpoint without a tokenizer, then with one that does not fit its embedding
    bare = tmp_path / "bare"
    make_hf_model(bare, "qwen2")
    err = _fails("up", "--out", str(tmp_path / "u2"), "--set", f"model.path={bare}")
    assert "TokenizerError" in err and "no tokenizer.json" in err
    small = tmp_path / "small"
    make_checkpoint(small, "qwen2", vocab_size=400)
    cfg = json.loads((small / "config.json").read_text())
    for f in small.glob("model*"):
        f.unlink()
    make_hf_model(small, "qwen2", vocab_size=cfg["vocab_size"] - 10)   # weights and config now 10 rows short
    err = _fails("eval", "--suite", "builtin", "--model", str(small), "--out", str(tmp_path / "e"), "--episodes", "1")
    assert "embedding has" in err
    # missing weight files
    shutil.rmtree(bare)
    make_hf_model(bare, "llama")
    for f in bare.glob("model-*"):
        f.unlink()
    err = _fails("serve", "--model", str(bare))
    assert "model.safetensors.index.json" in err and "model-00001-of-" in err
