"""A lossless tokenizer built offline: longest match over a vocabulary of words and grammar pieces, with a
byte fallback so any text round-trips. The project builds it from its own task vocabulary (no hub download)
and stores it as tokenizer.json beside the model.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable, Sequence

PAD, EOS, USER, ASSISTANT = "<|pad|>", "<|endoftext|>", "<|user|>", "<|assistant|>"
SPECIALS = [PAD, EOS, USER, ASSISTANT, "<|image|>"]

# Pieces of the UI-TARS action grammar and prompt words, so an action is a handful of tokens.
GRAMMAR = [
    "Action:", "Thought:", "Goal:", "Screen:", "Step",
    "click(target='", "click(start_box='", "left_double(start_box='", "right_single(start_box='",
    "drag(start_box='", "', end_box='", "hotkey(key='", "type(content='", "scroll(start_box='",
    "', direction='", "wait()", "finished()", "finished(content='", "call_user()", "')",
    "<|box_start|>", "<|box_end|>", "<point>", "</point>", "(", ")", ",", "'", "=", "[", "]", ":", ".", "\n",
    " ", "\\n",
]
# A widget on a text screen opens with " [role" (envd/builtin.py renders "[button Save]"): one piece instead of three
# (" ", "[", "button") cuts a screen's tokens by a third, which is a third less attention and compute per turn.
WIDGET_OPENERS = [" [button", " [menu", " [item", " [field", " [dialog", " [checkbox", " [window"]
BASE_WORDS = [
    "button", "menu", "item", "field", "dialog", "window", "open", "closed", "empty", "checkbox", "checked",
    "the", "a", "and", "then", "click", "press", "type", "in", "into", "on", "with", "of", "to", "select",
    "choose", "enter", "fill", "submit", "close", "dismiss", "done", "value", "focus", "focused", "label",
    "task", "title", "up", "down", "left", "right", "enter", "ctrl", "alt", "shift", "tab", "esc",
]


class Tokenizer:
    def __init__(self, pieces: Sequence[str]):
        if list(pieces[: len(SPECIALS)]) != SPECIALS:
            raise ValueError("tokenizer vocabulary must start with the special tokens")
        self.pieces = list(pieces)
        self.index = {p: i for i, p in enumerate(self.pieces)}
        self.byte_base = len(self.pieces)  # ids byte_base..byte_base+255 are raw bytes
        self.pad_id, self.eos_id = self.index[PAD], self.index[EOS]
        self.user_id, self.assistant_id = self.index[USER], self.index[ASSISTANT]
        self._maxlen = max(len(p) for p in self.pieces)
        self._first: dict[str, list[str]] = {}
        for p in sorted(self.pieces, key=len, reverse=True):
            self._first.setdefault(p[0], []).append(p)

    @property
    def vocab_size(self) -> int:
        return self.byte_base + 256

    @classmethod
    def build(cls, words: Iterable[str] = (), glue: Iterable[str] | None = None) -> "Tokenizer":
        """`words` become pieces. By default each also gets a space-prefixed piece (" Save"), as BPE vocabularies
        do. With `glue` (the fixed text around the words: "Goal: ", " [button ", " into "), words get no
        space-prefixed piece; the spaces go into the glue pieces instead, so a word has one id wherever it
        appears. A word the policy copies from the prompt into its answer ("Goal: click Save" ->
        "click(target='Save')") is then the same token on both sides, and the model need not learn a mapping
        " Save" -> "Save" for every word."""
        seen, out = set(), []
        glue = None if glue is None else list(glue)
        for p in [*SPECIALS, *GRAMMAR, *WIDGET_OPENERS, *(glue or ())]:
            if p not in seen:
                seen.add(p)
                out.append(p)
        for w in sorted(set(BASE_WORDS) | set(words)):
            for p in (w,) if glue is not None else (w, " " + w):
                if p not in seen:
                    seen.add(p)
                    out.append(p)
        return cls(out)

    def encode(self, text: str) -> list[int]:
        ids, i, n = [], 0, len(text)
        while i < n:
            for p in self._first.get(text[i], ()):
                if text.startswith(p, i):
                    ids.append(self.index[p])
                    i += len(p)
                    break
            else:
                ids.extend(self.byte_base + b for b in text[i].encode("utf-8"))
                i += 1
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        out, buf = [], bytearray()
        for t in ids:
            t = int(t)
            if self.byte_base <= t < self.byte_base + 256:
                buf.append(t - self.byte_base)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
            if not 0 <= t < self.byte_base:
                raise ValueError(f"token id {t} outside the vocabulary (size {self.vocab_size})")
            p = self.pieces[t]
            if skip_special and p in SPECIALS:
                continue
            out.append(p)
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def save(self, path: str | os.PathLike) -> None:
        pathlib.Path(path).write_text(self.to_json())

    def to_json(self) -> str:
        return json.dumps({"type": "tars-longest-match", "version": 1, "pieces": self.pieces})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        p = pathlib.Path(path)
        if p.is_dir():
            p = p / "tars_tokenizer.json"
        d = json.loads(p.read_text())
        if d.get("type") != "tars-longest-match":
            raise ValueError(f"{p}: not a tars tokenizer")
        return cls(d["pieces"])
