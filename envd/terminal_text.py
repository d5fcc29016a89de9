"""The terminal backend's text at its two ends: what a step may type or press (content checks, key names) and how
the shell's output reads on screen (ANSI sequences, carriage returns and backspaces resolved). Pure functions, no
sandbox: tested directly. Also the cap on what one command line may print (OutputSegment).
"""
from __future__ import annotations

import re

from envd.base import ActionError

MAX_CONTENT = 16384          # characters one type() may carry
MAX_LINE = 4000              # bytes of one line (the tty's canonical line buffer holds 4095)
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_CTRL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
KEYS = {"ctrl c", "ctrl d", "ctrl u", "ctrl l", "enter", "backspace"}
_KEY_ALIASES = {"control": "ctrl", "return": "enter", "^c": "ctrl c", "^d": "ctrl d", "^u": "ctrl u",
                "^l": "ctrl l", "bksp": "backspace"}


def clean_terminal_text(text: str) -> str:
    """What a terminal would show: ANSI sequences removed, `\\r` overwrites and backspaces applied."""
    text = _ANSI.sub("", text.replace("\r\n", "\n"))
    lines = []
    for line in text.split("\n"):
        if "\r" in line:
            line = [seg for seg in line.split("\r") if seg][-1] if line.strip("\r") else ""
        if "\b" in line:
            kept: list[str] = []
            for ch in line:
                if ch == "\b":
                    if kept:
                        kept.pop()
                else:
                    kept.append(ch)
            line = "".join(kept)
        lines.append(_CTRL.sub("", line))
    return "\n".join(lines)


def normalize_key(key: str) -> str:
    """'Control+C', 'ctrl-c', '^C' -> 'ctrl c' (compare with KEYS)."""
    k = " ".join(re.split(r"[\s+\-]+", key.strip().lower()))
    k = _KEY_ALIASES.get(k, k)
    return " ".join(_KEY_ALIASES.get(p, p) for p in k.split())


def check_content(content: str) -> str:
    """What a type() may carry into the terminal, line endings normalised; ActionError otherwise."""
    if not isinstance(content, str) or content == "":
        raise ActionError("type needs content (a command line; end it with \\n to run it)")
    if len(content) > MAX_CONTENT:
        raise ActionError(f"content is {len(content)} characters; at most {MAX_CONTENT} per step")
    content = content.replace("\r\n", "\n").replace("\r", "\n")
    if _CTRL.search(content):
        raise ActionError("content may not hold control characters (use hotkey for ctrl keys)")
    if any(len(line.encode()) > MAX_LINE for line in content.split("\n")):
        raise ActionError(f"a line longer than {MAX_LINE} bytes cannot be typed into the terminal")
    return content


class OutputSegment:
    """A sandboxed shell's output between two prompts (envd/sandbox.py), capped: the first `head` bytes go out as
    they come, the last `tail` are kept."""

    def __init__(self, cap: int):
        self.tail_cap = cap // 4
        self.head_left = cap - self.tail_cap
        self.tail = bytearray()
        self.dropped = self.total = 0

    def add(self, data: bytes) -> bytes:
        """The part of `data` to show now; the rest is held in the tail or dropped."""
        self.total += len(data)
        shown, data = data[:self.head_left], data[self.head_left:]
        self.head_left -= len(shown)
        if data:
            self.tail += data
            if len(self.tail) > self.tail_cap:
                cut = len(self.tail) - self.tail_cap
                self.dropped += cut
                del self.tail[:cut]
        return shown

    def close(self, cap: int) -> bytes:
        if not self.dropped:
            return bytes(self.tail)
        note = f"\n[... {self.dropped} bytes of output dropped (output cap {cap} bytes per command) ...]\n"
        return note.encode() + bytes(self.tail)
