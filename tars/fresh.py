"""A fresh checkpoint directory for training from scratch: a byte-level BPE tokenizer trained on the tasks' text and
a tiny random-initialised `transformers` model, saved in the standard Hugging Face files.

    corpus   the tasks' own conversations, rolled in-process and rendered with the chat template: the system prompt,
             every turn's user message (actor/tiny.py's observation_text) and the answer of the oracle or of a
             random policy (format_action). Builtin tasks: 2000 episodes, oracle and random alternating; other
             tasks (MiniWoB++: the DOM as text, in real Chromium): WEB_EPISODES per task of the noisy:0.5
             demonstrator (tars.demos.roll), on training seeds only. Nothing is hand-picked: the BPE trainer merges
             what is frequent.
    tokenizer core.bpe (ChatML template), saved with save_pretrained
    model    transformers' Qwen2 config and model class (its own initialisation, seeded), save_pretrained

The result is an ordinary checkpoint: `model.path` can name it, and anything the project does to a checkpoint it
does to this one.
"""
from __future__ import annotations

import json
import pathlib
import random

from actor.tiny import TINY_SYSTEM, format_action, observation_text
from core.outcome import Outcome
from envd import builtin


def task_corpus(env_ids: list[str], episodes: int = 2000, seed: int = 0, max_turns: int = 6) -> list[list[dict]]:
    """`episodes` builtin episodes as chat messages (oracle and random actions alternating), on the builtin ones of
    env_ids (builtin/mixed if there are none)."""
    names = [e.split("/", 1)[1] for e in env_ids if e.startswith("builtin/")] or ["mixed"]
    rng = random.Random(seed)
    envs = [builtin.make(n, {"max_steps": str(max_turns)}) for n in names]
    out = []
    for i in range(episodes):
        env = envs[i % len(envs)]
        r = env.reset(rng.randrange(1 << 30))
        msgs = [{"role": "system", "content": TINY_SYSTEM}]
        while True:
            msgs.append({"role": "user", "content": observation_text(r.text, r.instruction)})
            a = env.oracle_action() if i % 2 == 0 else env.random_action(rng)
            msgs.append({"role": "assistant", "content": format_action(a)})
            r = env.step(a)
            if r.outcome != Outcome.RUNNING:
                break
        out.append(msgs)
    return out


WEB_EPISODES = 60   # corpus episodes per non-builtin task (each a browser's episode: ~0.1 s of CPU)


def web_corpus(env_ids: list[str], seed: int = 0, max_turns: int = 6, env_options: dict | None = None) -> list[list[dict]]:
    """WEB_EPISODES episodes per env id of noisy:0.5 (the oracle or a random action, turn by turn) as chat messages."""
    from tars.demos import roll

    out = []
    for ep in roll(env_ids, WEB_EPISODES * len(env_ids), "noisy:0.5", seed, max_turns, env_options, keep="all"):
        msgs = [{"role": "system", "content": TINY_SYSTEM}]
        for text, instruction, a, note in ep:
            msgs += [{"role": "user", "content": observation_text(text, instruction, note)},
                     {"role": "assistant", "content": format_action(a)}]
        out.append(msgs)
    return out


def build_tokenizer(out: str | pathlib.Path, vocab_size: int, env_ids: list[str], seed: int = 0, max_turns: int = 6,
                    env_options: dict | None = None):
    from core.bpe import rendered_corpus, save_tokenizer, train_bpe
    from tars.demos import is_builtin

    other = [e for e in env_ids if not is_builtin(e)]
    corpus = web_corpus(other, seed, max_turns, env_options) if other else []
    if len(other) < len(env_ids) or not corpus:   # builtin tasks (or nothing else rolled): their corpus as before
        corpus = task_corpus(env_ids, seed=seed) + corpus
    hf = train_bpe(rendered_corpus(corpus, "chatml"), vocab_size, template="chatml")
    save_tokenizer(hf, out)
    return hf


def build_model(m, out: str | pathlib.Path, env_ids: list[str], max_turns: int = 6,
                env_options: dict | None = None) -> pathlib.Path:
    """model config section `m` (core.config.ModelConfig) -> a checkpoint directory at `out` (tokenizer included)."""
    import torch
    import transformers

    out = pathlib.Path(out)
    tok = build_tokenizer(out, m.vocab_size, env_ids, m.seed, max_turns, env_options)
    cfg = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_positions, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings,
        initializer_range=m.init_std, rms_norm_eps=1e-6, bos_token_id=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(m.seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id,
                                                             "pad_token_id": tok.pad_token_id}, indent=2))
    return out


_CACHED: dict = {}
BUILDER_VERSION = 1   # part of the shared directory's name: a changed builder never reads an older one's files


def shared_tokenizer():
    """builtin_tokenizer in a per-user directory under the system's temp dir (benches, tests)."""
    import os
    import tempfile

    return builtin_tokenizer(pathlib.Path(tempfile.gettempdir()) / f"tars-builtin-tokenizer-v{BUILDER_VERSION}-{os.getuid()}")


def builtin_tokenizer(path: str | pathlib.Path):
    """A core.chat.ChatTokenizer for the builtin tasks (vocabulary 1024), built into `path` once per process: for
    benches and tests that need a real tokenizer but no model."""
    from core.chat import ChatTokenizer

    path = pathlib.Path(path)
    if str(path) not in _CACHED:
        if not (path / "tokenizer.json").is_file():
            import os
            import shutil

            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            build_tokenizer(tmp, 1024, ["builtin/mixed"])
            try:
                os.rename(tmp, path)       # atomic: a concurrent builder's directory wins, ours goes
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        _CACHED[str(path)] = ChatTokenizer.load(path)
    return _CACHED[str(path)]
