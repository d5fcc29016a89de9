"""A scripted MiniWoB++ policy that reads the DOM: the next correct UI-TARS action for click/focus/type tasks.

It backs scripted demonstrations and the `oracle` baseline, and lets tests check that the action mapping really
solves tasks. It reads only what a text policy is shown (the element list) plus MiniWoB's own parse of the
instruction (`fields`, e.g. {"target": "Ok"}); it never reads the task's hidden answer.
"""
from __future__ import annotations

from typing import Callable

from envd.base import Action
from envd.miniwob_actions import Element


class NoOracle(NotImplementedError):
    """The oracle does not know this task (or this page state)."""


def _ref(e: Element) -> str:
    return f"[{e.ref}]"


def _click(e: Element) -> Action:
    return Action("click", target=_ref(e))


def _type_into(e: Element, text: str) -> Action:
    return Action("type", target=_ref(e), content=text)


def _buttons(els: list[Element]) -> list[Element]:
    return [e for e in els if e.tag in ("button", "input_button", "input_submit")]


def _button(els: list[Element], text: str) -> Element:
    """The button labelled exactly `text` (tasks tell "Okay" from "okay"), else one labelled so in another case."""
    for same in (lambda a, b: a == b, lambda a, b: a.lower() == b.lower()):
        for e in _buttons(els):
            if same(e.text.strip(), text.strip()):
                return e
    raise NoOracle(f"no button labelled {text!r}")


def _label_text(els: list[Element], control: Element) -> str:
    """The text next to a checkbox or radio: the text runs that share its <label>."""
    return " ".join(e.text for e in els if e.ref < 0 and e.parent == control.parent and e.parent > 0).strip()


def _fill_then_submit(els: list[Element], wanted: list[tuple[Element, str]], submit: str) -> Action:
    for field, text in wanted:
        if str(field.value or "") != text:
            if field.value:
                raise NoOracle(f"field {_ref(field)} holds {field.value!r}, not a prefix the oracle can finish")
            return _type_into(field, text)
    return _click(_button(els, submit))


def _inputs(els: list[Element], *tags: str) -> list[Element]:
    return [e for e in els if e.tag in tags]


def _by_id(els: list[Element], id_: str) -> Element:
    for e in els:
        if e.id == id_:
            return e
    raise NoOracle(f"no element #{id_}")


# ---- per-task rules -------------------------------------------------------------------------------------------

def _click_button(els, f, u):
    return _click(_button(els, f["target"]))


def _click_test(els, f, u):
    return _click(_buttons(els)[0])


def _click_link(els, f, u):
    for e in els:
        if "alink" in e.classes.split() and e.text == f["target"]:
            return _click(e)
    raise NoOracle(f"no link {f['target']!r}")


def _close_button(els: list[Element]) -> Element:
    for e in els:
        if e.tag == "button" and "ui-dialog-titlebar-close" in e.classes.split():
            return e
    raise NoOracle("no dialog close button")


def _click_dialog(els, f, u):
    return _click(_close_button(els))


def _click_dialog_2(els, f, u):
    return _click(_close_button(els) if f["target"].lower() == "x" else _button(els, f["target"]))


def _click_tab(els, f, u):
    for e in els:
        if e.tag == "a" and e.text == f"Tab #{f['target']}":
            return _click(e)
    raise NoOracle(f"no tab #{f['target']}")


def _click_option(els, f, u):
    for r in _inputs(els, "input_radio"):
        if _label_text(els, r) == f["target"]:
            return _click(_button(els, "Submit")) if r.value is True else _click(r)
    raise NoOracle(f"no option {f['target']!r}")


def _click_checkboxes(els, f, u):
    want = {v for k, v in f.items() if k.startswith("target")}
    for c in _inputs(els, "input_checkbox"):
        if (_label_text(els, c) in want) != (c.value is True):
            return _click(c)
    return _click(_button(els, "Submit"))


def _click_button_sequence(els, f, u):
    one = _button(els, "ONE")
    return _click(_button(els, "TWO") if one.tampered else one)


_WIDGET_TAGS = {"radio": "input_radio", "checkbox": "input_checkbox", "text": "input_text", "textarea": "textarea",
                "button": "button"}


def _click_widget(els, f, u):
    tag = _WIDGET_TAGS.get(f["target"])
    for e in els:
        if e.tag == tag:
            return _click(e)
    raise NoOracle(f"no {f['target']!r} widget")


def _enter_text(els, f, u):
    return _fill_then_submit(els, [(_inputs(els, "input_text")[0], f["target"])], "Submit")


def _enter_text_2(els, f, u):
    text = f["text"].upper() if f["case"] == "upper" else f["text"].lower()
    return _fill_then_submit(els, [(_inputs(els, "input_text")[0], text)], "Submit")


def _enter_password(els, f, u):
    return _fill_then_submit(els, [(_by_id(els, "password"), f["target"]), (_by_id(els, "verify"), f["target"])],
                             "Submit")


def _login_user(els, f, u):
    return _fill_then_submit(els, [(_by_id(els, "username"), f["username"]), (_by_id(els, "password"), f["password"])],
                             "Login")


def _focus_text(els, f, u):
    return _click(_inputs(els, "input_text")[0])


def _focus_text_2(els, f, u):
    return _click(_inputs(els, "input_text")[int(f["target"]) - 1])


def _click_collapsible(els, f, u):
    for e in els:
        if e.tag == "h3" and "ui-accordion-header-collapsed" in e.classes.split():
            return _click(e)
    return _click(_button(els, "Submit"))


RULES: dict[str, Callable[[list[Element], dict[str, str], str], Action]] = {
    "click-button": _click_button, "click-test": _click_test, "click-test-2": _click_button,
    "click-test-transfer": _click_button, "click-link": _click_link, "click-dialog": _click_dialog,
    "click-dialog-2": _click_dialog_2, "click-tab": _click_tab, "click-option": _click_option,
    "click-checkboxes": _click_checkboxes, "click-checkboxes-large": _click_checkboxes,
    "click-checkboxes-transfer": _click_checkboxes, "click-button-sequence": _click_button_sequence,
    "click-widget": _click_widget, "enter-text": _enter_text, "enter-text-dynamic": _enter_text,
    "enter-text-2": _enter_text_2, "enter-password": _enter_password, "login-user": _login_user,
    "focus-text": _focus_text, "focus-text-2": _focus_text_2, "click-collapsible": _click_collapsible,
    "click-collapsible-nodelay": _click_collapsible,
}
ORACLE_TASKS = tuple(sorted(RULES))


def oracle_action(task: str, utterance: str, fields: dict[str, str], elements: list[Element]) -> Action:
    """The next action that makes progress on `task`; NoOracle when the task (or page) is outside the rules."""
    rule = RULES.get(task)
    if rule is None:
        raise NoOracle(f"no oracle for miniwob/{task}; it knows {list(ORACLE_TASKS)}")
    try:
        return rule(elements, fields, utterance)
    except (KeyError, IndexError) as e:
        raise NoOracle(f"miniwob/{task}: the page or instruction is not as the oracle expects ({e!r})") from None
