"""Train a byte-level BPE tokenizer offline and save it with a chat template, in the standard files.

The project's fresh models (the quickstart, the tests' tiny Qwen2 and Llama checkpoints) get their tokenizer from
here: `tokenizers`' BPE trainer over a text corpus, wrapped as a `transformers` PreTrainedTokenizerFast and written
with save_pretrained (tokenizer.json, tokenizer_config.json with the chat template, special_tokens_map.json). Any
HF-format checkpoint's own tokenizer is used as it is instead (core/chat.py).
"""
from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable

# ChatML, the template of Qwen2/Qwen2.5 (without the tool-calling branches).
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_SPECIALS = {"pad": "<|endoftext|>", "eos": "<|im_end|>", "bos": None,
                   "extra": ["<|im_start|>", "<|image|>"]}

# Llama 3's header template.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = {"pad": "<|finetune_right_pad_id|>", "eos": "<|eot_id|>", "bos": "<|begin_of_text|>",
                   "extra": ["<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|image|>"]}

# Qwen2-VL / Qwen2.5-VL: ChatML with the vision tokens (a screenshot is <|vision_start|><|image_pad|>...<|vision_end|>).
QWEN_VL_SPECIALS = {"pad": "<|endoftext|>", "eos": "<|im_end|>", "bos": None,
                    "extra": ["<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]}

TEMPLATES = {"chatml": (CHATML, CHATML_SPECIALS), "llama3": (LLAMA3, LLAMA3_SPECIALS),
             "qwen_vl": (CHATML, QWEN_VL_SPECIALS)}


def rendered_corpus(conversations: Iterable[list[dict]], template: str = "chatml") -> Iterable[str]:
    """Conversations (lists of {"role", "content"}) as the chat template renders them, cut at its special tokens:
    the text a tokenizer trained on it will see, role names and line breaks included."""
    import re

    import jinja2

    chat_template, sp = TEMPLATES[template]
    specials = [t for t in (sp["pad"], sp["eos"], sp["bos"], *sp["extra"]) if t]
    tpl = jinja2.Environment().from_string(chat_template)
    cut = re.compile("|".join(map(re.escape, specials)))
    for msgs in conversations:
        text = tpl.render(messages=msgs, add_generation_prompt=False, bos_token=sp["bos"] or "")
        yield from (piece for piece in cut.split(text) if piece)


def train_bpe(corpus: Iterable[str], vocab_size: int, template: str = "chatml", min_frequency: int = 2):
    """A PreTrainedTokenizerFast: byte-level BPE trained on `corpus` (texts; rendered_corpus gives a chat corpus),
    the template's special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {template!r}")
    chat_template, sp = TEMPLATES[template]
    specials = [t for t in (sp["pad"], sp["eos"], sp["bos"], *sp["extra"]) if t]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=sp["pad"], eos_token=sp["eos"],
                                 bos_token=sp["bos"], additional_special_tokens=list(sp["extra"]),
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = chat_template
    return hf


def save_tokenizer(hf, path: str | os.PathLike) -> pathlib.Path:
    """save_pretrained into path (created); returns the path."""
    p = pathlib.Path(path)
    p.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(p))
    return p
