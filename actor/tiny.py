"""The `tiny` prompt style: a compact chat format for small text-only policies trained from scratch.

    <|user|>Screen: window Mail [button Save] [menu File] ... Goal: click Save<|assistant|>click(target='Save')<|endoftext|>

Each turn appends the next observation to the same token sequence, so the conversation is only ever extended
(never re-tokenised) and the engine's prefix cache serves every earlier turn. Actions use the UI-TARS grammar with
our text-addressed extension `target='LABEL'`; coordinates (`start_box`) are accepted by the parser as well.
"""
from __future__ import annotations

from core.action import CLICKS, Action
from core.tokenizer import Tokenizer


# The note the actor puts before the next observation after an invalid action.
INVALID_NOTE = "Invalid action. "
# observation_text's fixed text, the note included, for a glued tokenizer (core.tokenizer.Tokenizer.build's `glue`).
PROMPT_GLUE = ["Screen: ", " Goal: ", INVALID_NOTE]


def observation_text(text: str, instruction: str, note: str = "") -> str:
    # The goal comes last, right before the answer, so the words the policy must act on sit close to it.
    return f"{note}Screen: {text} Goal: {instruction}"


def turn_prompt_ids(tok: Tokenizer, text: str, instruction: str, note: str = "") -> list[int]:
    return [tok.user_id, *tok.encode(observation_text(text, instruction, note)), tok.assistant_id]


def format_action(a: Action) -> str:
    """Action -> the text a policy writes (the inverse of the parser, for demonstrations)."""
    t = a.type
    if t in CLICKS and a.target:
        return f"{t}(target='{a.target}')"
    if t in CLICKS and a.point is not None:
        x, y = a.point
        return f"{t}(start_box='({int(x)},{int(y)})')"
    if t == "type":
        return "type(content='" + a.content.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "')"
    if t == "hotkey":
        return f"hotkey(key='{a.key}')"
    if t in ("wait", "finished", "call_user"):
        return f"{t}()"
    raise ValueError(f"cannot format action {a!r}")


def answer_ids(tok: Tokenizer, action: Action) -> list[int]:
    return [*tok.encode(format_action(action)), tok.eos_id]
