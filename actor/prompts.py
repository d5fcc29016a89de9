"""UI-TARS-style system prompts, and which history turns keep their screenshot.

The layout follows the published UI-TARS prompts (intro, "## Output Format", "## Action Space", "## Note",
"## User Instruction") so a UI-TARS checkpoint sees the format it was trained on. The action lists are limited to
what envd executes (core.action.ACTION_TYPES): UI-TARS' mobile-only actions (long_press, press_home, press_back,
open_app) have no envd counterpart, so MOBILE_USE expresses them with drag and hotkey instead, and
actor.parsing rejects them as unknown actions.

Coordinates: the default "box" form, start_box='<|box_start|>(x1,y1)<|box_end|>', is UI-TARS 1.0's (relative
0..1000); the "point" form, point='<point>x1 y1</point>', is UI-TARS 1.5's (absolute pixels of the resized image).
The parser accepts both either way; pick the one the checkpoint was trained with, and the matching to_screen mode.
The prompt's own text is core.chat.Trusted (system_parts): `<|box_start|>` is a special token of Qwen2-VL's tokenizer,
and the model was trained on its id; the task's instruction inside the prompt stays plain text.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.chat import Trusted

_INTRO = ("You are a GUI agent. You are given a task and your action history, with screenshots. "
          "You need to perform the next action to complete the task.")
_FORMAT = "## Output Format\n```\nThought: ...\nAction: ...\n```"

# {P1}/{P2} become a point argument in the chosen form; the comments after '#' are part of the prompt, they tell
# the model the conventions the parser relies on (escapes, trailing \n to submit, lowercase space-split keys).
_TYPE = ("type(content='xxx') # Use escape characters \\', \\\", and \\n in content part to ensure we can parse the "
         "content in normal python string format. If you want to submit your input, use \\n at the end of content.")
_FINISHED = ("finished(content='xxx') # Use escape characters \\', \\\", and \\n in content part to ensure we can "
             "parse the content in normal python string format.")
_ACTIONS = {
    "computer": [
        "click({P1})",
        "left_double({P1})",
        "right_single({P1})",
        "drag({S1}, {E2})",
        "hotkey(key='ctrl c') # Split keys with a space and use lowercase. Do not use more than 3 keys in one "
        "hotkey action.",
        _TYPE,
        "scroll({P1}, direction='down or up or right or left') # Show more information on the `direction` side.",
        "wait() # Sleep for 5s and take a screenshot to check for any changes.",
        _FINISHED,
        "call_user() # Submit the task and call the user when the task is unsolvable, or when you need the "
        "user's help.",
    ],
    "mobile": [
        "click({P1}) # Tap.",
        "left_double({P1}) # Double tap.",
        "drag({S1}, {E2}) # Swipe from the start point to the end point; also use it to pull down the "
        "notification shade.",
        "hotkey(key='back') # Press a system key: 'back', 'home' or 'enter'.",
        _TYPE,
        "scroll({P1}, direction='down or up or right or left') # Show more information on the `direction` side.",
        "wait() # Sleep for 5s and take a screenshot to check for any changes.",
        _FINISHED,
        "call_user() # Submit the task and call the user when the task is unsolvable, or when you need the "
        "user's help.",
    ],
    "browser": [
        "click({P1})",
        "left_double({P1})",
        "right_single({P1})",
        "drag({S1}, {E2})",
        "hotkey(key='ctrl l') # Split keys with a space and use lowercase. Use 'ctrl l' to focus the address bar, "
        "'alt left' to go back, 'ctrl t' for a new tab.",
        _TYPE,
        "scroll({P1}, direction='down or up or right or left') # Show more information on the `direction` side "
        "of the page.",
        "wait() # Sleep for 5s and take a screenshot, e.g. while a page is loading.",
        _FINISHED,
        "call_user() # Submit the task and call the user when the task is unsolvable, or when you need the "
        "user's help (e.g. a login or a captcha).",
    ],
}
_NOTES = {
    "computer": ["- Use {language} in `Thought` part.",
                 "- Write a small plan and finally summarize your next action (with its target element) in one "
                 "sentence in `Thought` part."],
    "mobile": ["- Use {language} in `Thought` part.",
               "- Write a small plan and finally summarize your next action (with its target element) in one "
               "sentence in `Thought` part.",
               "- To open an app, go home and tap its icon; to type, tap the text field first."],
    "browser": ["- Use {language} in `Thought` part.",
                "- Write a small plan and finally summarize your next action (with its target element) in one "
                "sentence in `Thought` part.",
                "- Work inside the browser window; if the page is not what you expect, check the address bar."],
}
_POINT_FORMS = {
    "box": {"P1": "start_box='<|box_start|>(x1,y1)<|box_end|>'",
            "S1": "start_box='<|box_start|>(x1,y1)<|box_end|>'",
            "E2": "end_box='<|box_start|>(x3,y3)<|box_end|>'"},
    "point": {"P1": "point='<point>x1 y1</point>'",
              "S1": "start_point='<point>x1 y1</point>'",
              "E2": "end_point='<point>x2 y2</point>'"},
}
STYLES = tuple(_ACTIONS)


def _style(style: str) -> str:
    # Accept the constant names too ("COMPUTER_USE", "mobile_use"), since callers read them off this module.
    s = style.lower().removesuffix("_use")
    if s not in _ACTIONS:
        raise ValueError(f"unknown prompt style {style!r}; expected one of {STYLES}")
    return s


def action_space_text(style: str, point_form: str = "box") -> str:
    """The "## Action Space" body for a style, one action per line."""
    if point_form not in _POINT_FORMS:
        raise ValueError(f"point_form must be one of {tuple(_POINT_FORMS)}, got {point_form!r}")
    return "\n".join(line.format(**_POINT_FORMS[point_form]) for line in _ACTIONS[_style(style)])


def _template(style: str, point_form: str = "box") -> str:
    # {language} and {instruction} stay as placeholders; build_system_prompt fills them with str.replace so that
    # braces in a user's instruction are never read as format fields.
    s = _style(style)
    return (f"{_INTRO}\n\n{_FORMAT}\n\n## Action Space\n\n{action_space_text(s, point_form)}\n\n\n"
            f"## Note\n" + "\n".join(_NOTES[s]) + "\n\n## User Instruction\n{instruction}\n")


COMPUTER_USE = _template("computer")
MOBILE_USE = _template("mobile")
BROWSER = _template("browser")


def system_parts(style: str, instruction: str, language: str = "English", point_form: str = "box") -> list[str]:
    """The full system prompt for one task as [its text before the instruction, the instruction, its text after]:
    the prompt's own text is Trusted (the special tokens in it, UI-TARS-1.0's <|box_start|>, are meant as tokens,
    as UI-TARS's inference code tokenizes them), the task's instruction (the environment's words) stays plain."""
    head, _, tail = _template(style, point_form).replace("{language}", language).partition("{instruction}")
    return [Trusted(head), instruction, Trusted(tail)]


def build_system_prompt(style: str, instruction: str, language: str = "English", point_form: str = "box") -> str:
    """The full system prompt for one task, as one text."""
    return "".join(system_parts(style, instruction, language, point_form))


def history_window(turns: Sequence[Any], k: int = 5) -> list[bool]:
    """For each turn (oldest first, the current one last): True if it keeps its screenshot as an image.

    Only the last k turns do; older ones are shown by their text observation (plus their Thought/Action, which are
    always kept). UI-TARS does the same with k of about 5: a screenshot costs on the order of a thousand tokens, and
    the oldest ones add little to the next decision. Note that a turn losing its image changes the prompt's prefix,
    so an engine's prefix cache only reuses the part before the oldest turn that changed.
    """
    n = len(turns)
    keep = max(0, min(int(k), n))
    return [i >= n - keep for i in range(n)]
