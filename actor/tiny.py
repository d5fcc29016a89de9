"""The turns of an episode as token ids, in the checkpoint's own chat template (core.chat's token-in/token-out rule).

    turn 0:  chat template over [system prompt, user: <screenshot placeholders> Screen: ... Goal: ...] + generation prompt
    turn k:  [end-of-turn if the last output lacked it] + user message + generation prompt, appended

The episode's ids are only ever extended (never re-tokenised), so the engine's prefix cache serves every earlier
turn and the learner trains on exactly the ids the engine produced. `turn_ids` is the one place that builds a
turn's prompt; the actor's episodes and the SFT demonstrations (tars/demos.py) both call it.

The system prompt (actor.system_prompt): `auto` (tiny here; a vision-language checkpoint on a GUI task gets the
UI-TARS computer-use prompt, actor/uitars.py), `tiny`, a one-line instruction for small policies trained from scratch, or
a UI-TARS prompt (`computer`, `browser`, `mobile`: actor/prompts.py, the task's instruction inside it), or `none`.
Actions use the UI-TARS grammar with our text-addressed extension `target='LABEL'`; coordinates (`start_box`) are
accepted by the parser as well.
"""
from __future__ import annotations

from core.action import CLICKS, Action
from core.chat import ChatTokenizer, Content

# The note the actor puts before the next observation after an invalid action.
INVALID_NOTE = "Invalid action. "
TINY_SYSTEM = "Act on the screen to reach the goal. Answer with one action."
SYSTEM_PROMPTS = ("auto", "tiny", "none", "computer", "browser", "mobile")


UITARS_PROMPTS = ("computer", "browser", "mobile")  # the UI-TARS prompts (actor/prompts.py)


def system_prompt(style: str, instruction: str) -> Content:
    """A style's system prompt: a text, or a UI-TARS prompt's parts (actor.prompts.system_parts: its own text
    Trusted, the instruction plain)."""
    # "auto" is tiny here; a vision-language checkpoint's episodes resolve it first (actor/uitars.py).
    if style in ("tiny", "auto"):
        return TINY_SYSTEM
    if style == "none":
        return ""
    if style in UITARS_PROMPTS:
        from actor.prompts import system_parts

        return system_parts(style, instruction)
    raise ValueError(f"actor.system_prompt must be one of {SYSTEM_PROMPTS}, got {style!r}")


def observation_text(text: str, instruction: str, note: str = "") -> str:
    # The goal comes last, right before the answer, so the words the policy must act on sit close to it.
    return f"{note}Screen: {text} Goal: {instruction}"


def clip_observation(tok: ChatTokenizer, text: str, budget: int) -> str:
    """`text` if it is at most `budget` tokens, else its first lines (the first tokens, when one line is already too
    long) within the budget and a marker saying how much was cut: never clipped silently. budget 0 = no budget."""
    if budget <= 0 or len(text.encode("utf-8")) <= budget:  # a token covers at least one byte: fits, no encoding
        return text
    ids = tok.encode(text)
    if len(ids) <= budget:
        return text
    marker = f"\n[observation clipped: {len(ids)} tokens, the first ~{budget} shown]"
    keep = max(0, budget - len(tok.encode(marker)))
    head = tok.decode(ids[:keep]).rstrip("\ufffd")  # a character cut in its bytes decodes as U+FFFD
    nl = head.rfind("\n")
    if nl > len(head) // 2:  # end on a whole line (an element of a DOM listing) when that keeps most of it
        head = head[:nl]
    return head.rstrip() + marker


def turn_ids(tok: ChatTokenizer, style: str, text: str, instruction: str, note: str = "", first: bool = False,
             closed: bool = True, images: int = 0, obs_budget: int = 0) -> list[int]:
    """The ids one turn appends: the first turn's whole prompt, or a later turn's user message and generation prompt.
    `closed`: the previous output ended with the end-of-turn token; `images`: placeholders before the text;
    `obs_budget`: the observation text's token budget (clip_observation; 0 = none)."""
    text = clip_observation(tok, text, obs_budget)
    user = [images, observation_text(text, instruction, note)] if images else observation_text(text, instruction, note)
    if first:
        return first_prompt(tok, style, system_prompt(style, instruction), user)
    return tok.next_turn(user, closed)


def first_prompt(tok: ChatTokenizer, style: str, prompt: Content, user: Content) -> list[int]:
    """A first prompt: a UI-TARS style's prompt (computer, browser, mobile; its parts, system_prompt) opens the first
    user message, where UI-TARS's own inference code puts it (the template's default system message stays, e.g.
    Qwen2-VL's "You are a helpful assistant."); the other styles' text is the system message."""
    parts = lambda c: [c] if isinstance(c, str) else list(c)  # noqa: E731
    if style in UITARS_PROMPTS and prompt:
        return tok.first_prompt("", [*parts(prompt), *parts(user)])
    return tok.first_prompt("".join(parts(prompt)), user)


def format_action(a: Action, point_form: str = "box") -> str:
    """Action -> the text a policy writes (the inverse of the parser, for demonstrations). A click names its target
    where it has one, else its point: start_box='(x,y)' (point_form "box", UI-TARS-1.0) or point='<point>x y</point>'
    ("point", UI-TARS-1.5)."""
    t = a.type
    if t in CLICKS and a.target:
        return f"{t}(target='{a.target}')"
    if t in CLICKS and a.point is not None:
        x, y = (int(v) for v in a.point)
        return f"{t}(point='<point>{x} {y}</point>')" if point_form == "point" else f"{t}(start_box='({x},{y})')"
    if t == "type":  # the target first: content is free text that runs to the last "')" (actor.parsing)
        where = f"target='{a.target}', " if a.target else ""
        return f"type({where}content='" + a.content.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "')"
    if t == "hotkey":
        return f"hotkey(key='{a.key}')"
    if t in ("wait", "finished", "call_user"):
        return f"{t}()"
    raise ValueError(f"cannot format action {a!r}")


def answer_ids(tok: ChatTokenizer, action: Action) -> list[int]:
    """What the policy should generate for an action: its text and the end-of-turn token."""
    return tok.answer(format_action(action))
