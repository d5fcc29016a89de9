"""Tests for actor/parsing.py and actor/prompts.py.

tests/data/uitars_strings.json holds realistic UI-TARS outputs with what the ui-tars package (0.5.1,
parse_action_to_structure_output, the ast-based parser) made of them, so our parser is checked against it without
the package installed. ui-tars' conventions differ from ours and are mapped here, not in our output:
  - it stores start_box/end_box as str([x1, y1, x2, y2]) normalised to 0..1 (a point is a degenerate box); we keep
    model coordinates and map them with to_screen(..., screen 1x1) to compare;
  - it calls the start point start_box whatever the model wrote (point=, start_point=);
  - it left-strips every argument value; we keep typed text verbatim;
  - its thought is None without a "Thought:"; ours is "";
  - it does not strip <|box_start|>/<|box_end|> (a skip_special_tokens decode does), so it was fed uitars_input.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from actor import prompts
from actor.parsing import (
    ACTION_TYPES, MAX_ACTIONS, ParseError, on_screen, parse_point, parse_response, smart_resize, to_screen,
)
from core.action import Action

FIXTURE = json.loads((Path(__file__).parent / "data" / "uitars_strings.json").read_text(encoding="utf-8"))


def one(text: str) -> Action:
    _, acts = parse_response(text)
    assert len(acts) == 1
    return acts[0]


# ============================================================================ against ui-tars
@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: c["text"][-40:])
@pytest.mark.parametrize("mode", ["relative", "absolute"])
def test_matches_uitars(case, mode):
    ref = case[f"uitars_{mode}"]
    assert isinstance(ref, list), ref
    meta = FIXTURE["meta"][mode]
    thought, acts = parse_response(case["text"])
    assert len(acts) == len(ref)
    assert thought == (ref[0]["thought"] or "")
    for a, r in zip(acts, ref):
        assert a.type == r["action_type"]
        inputs = dict(r["action_inputs"])
        for ours, theirs in ((a.point, "start_box"), (a.end_point, "end_box")):
            if theirs not in inputs:
                assert ours is None
                continue
            box = json.loads(inputs.pop(theirs))   # str([x1, y1, x2, y2]) of floats is valid JSON
            want = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)
            if mode == "relative":
                got = to_screen(ours, "relative", 1, 1)
            else:
                got = to_screen(ours, "absolute", 1, 1, image_w=meta["origin_resized_width"],
                                image_h=meta["origin_resized_height"], max_pixels=meta["max_pixels"],
                                min_pixels=meta["min_pixels"])
            assert got == pytest.approx(want, abs=1e-9)
        assert a.content.lstrip() == inputs.pop("content", "")
        assert a.key == inputs.pop("key", "")
        assert a.direction == inputs.pop("direction", "")
        assert not inputs, f"unmapped ui-tars fields {inputs}"


def test_fixture_covers_the_grammar():
    cases = FIXTURE["cases"]
    assert len(cases) >= 50
    types = {r["action_type"] for c in cases for r in c["uitars_relative"]}
    assert types == set(ACTION_TYPES)
    texts = [c["text"] for c in cases]
    for needle in ("<point>", "<|box_start|>", "start_point=", "\\n')", "\\'", "北京", "\n\n", "Reflection:"):
        assert any(needle in t for t in texts), needle
    assert any(not t.startswith(("Thought", "Reflection")) for t in texts)


# ============================================================================ grammar
def test_basic_and_to_dict():
    thought, acts = parse_response("Thought: Save it.\nAction: click(start_box='(100,200)')")
    assert thought == "Save it."
    assert acts[0].to_dict() == {"type": "click", "point": [100.0, 200.0]}
    assert acts[0].raw == "click(start_box='(100,200)')"


@pytest.mark.parametrize("text,env", [
    ("click(point='<point>12 34</point>')", {"type": "click", "point": [12.0, 34.0]}),
    ("left_double(start_point='<point>1 2</point>')", {"type": "left_double", "point": [1.0, 2.0]}),
    ("right_single(start_box='<|box_start|>(5,6)<|box_end|>')", {"type": "right_single", "point": [5.0, 6.0]}),
    ("click(start_box='(10,20,30,60)')", {"type": "click", "point": [20.0, 40.0]}),
    ("click(start_box='<bbox>10 20 30 60</bbox>')", {"type": "click", "point": [20.0, 40.0]}),
    ("click(start_box='[7, 8]')", {"type": "click", "point": [7.0, 8.0]}),
    ("click(start_box=' ( 7 , 8 ) ')", {"type": "click", "point": [7.0, 8.0]}),
    ("click(target='Save')", {"type": "click", "target": "Save"}),
    ("click(target=\"e12\")", {"type": "click", "target": "e12"}),
    ("drag(start_box='(1,2)', end_box='(3,4)')", {"type": "drag", "point": [1.0, 2.0], "end_point": [3.0, 4.0]}),
    ("drag(start_point='<point>1 2</point>', end_point='<point>3 4</point>')",
     {"type": "drag", "point": [1.0, 2.0], "end_point": [3.0, 4.0]}),
    ("hotkey(key='ctrl c')", {"type": "hotkey", "key": "ctrl c"}),
    ("type(content='hi\\n')", {"type": "type", "content": "hi\n"}),
    ("type(content='')", {"type": "type"}),
    ("scroll(start_box='(5,5)', direction='down')", {"type": "scroll", "point": [5.0, 5.0], "direction": "down"}),
    ("scroll(direction='UP')", {"type": "scroll", "direction": "up"}),
    ("scroll(target='List', direction='left')", {"type": "scroll", "target": "List", "direction": "left"}),
    ("wait()", {"type": "wait"}),
    ("finished()", {"type": "finished"}),
    ("finished(content='done')", {"type": "finished", "content": "done"}),
    ("call_user()", {"type": "call_user"}),
    ("click( start_box = '(1,2)' , )", {"type": "click", "point": [1.0, 2.0]}),
])
def test_each_form(text, env):
    a = one(text)
    assert a.to_dict() == env
    assert one("Action: " + text).to_dict() == env
    assert one("Thought: x\nAction: " + text).to_dict() == env


@pytest.mark.parametrize("src,want", [
    (r"type(content='It\'s')", "It's"),
    (r"type(content='say \"hi\"')", 'say "hi"'),
    (r"type(content='a\nb\tc')", "a\nb\tc"),
    (r"type(content='C:\\dir')", "C:\\dir"),
    (r"type(content='keep \d as is')", "keep \\d as is"),
    ("type(content='literal\nnewline')", "literal\nnewline"),
    ("type(content=\"double 'quoted'\")", "double 'quoted'"),
    ("type(content='it's unescaped')", "it's unescaped"),          # a forgotten escape is recovered
    ("type(content='北京天气预报\\n')", "北京天气预报\n"),
    ("type(content='  spaced ')", "  spaced "),
])
def test_type_escapes(src, want):
    a = one(src)
    assert a.content == want
    assert a.submit == want.endswith("\n")


def test_multiple_actions_and_labels():
    t = "Thought: two\nAction: click(start_box='(1,2)')\n\ntype(content='x\\n')\n\nAction: wait()"
    thought, acts = parse_response(t)
    assert thought == "two"
    assert [a.type for a in acts] == ["click", "type", "wait"]
    assert [a.type for a in parse_response("hotkey(key='a')\nhotkey(key='b')")[1]] == ["hotkey", "hotkey"]


def test_too_many_actions():
    assert len(parse_response("wait()\n" * MAX_ACTIONS)[1]) == MAX_ACTIONS
    with pytest.raises(ParseError, match="more than"):
        parse_response("wait()\n" * (MAX_ACTIONS + 1))


def test_thought_forms():
    assert parse_response("Action: wait()")[0] == ""
    assert parse_response("Thought: line1\nline2\nAction: wait()")[0] == "line1\nline2"
    assert parse_response("Thought: I'll check the Action: menu\nAction: wait()")[0] == "I'll check the Action: menu"
    assert parse_response("Thought: inline. Action: wait()")[0] == "inline."
    assert parse_response("I will wait.\nwait()")[0] == "I will wait."                 # no "Action:" label
    assert parse_response("Reflection: r\nAction_Summary: s\nAction: wait()")[0] == "s"
    assert parse_response("Thought：中文冒号\nAction：wait()")[0] == "中文冒号"
    # "Action:" inside the typed text of a bare call is text, not a label
    assert one("type(content='Action: go')").content == "Action: go"


def test_think_is_stripped():
    # Qwen-style reasoning is not the thought (UI-TARS-desktop strips it); an Action: inside it is no action
    assert parse_response("<think>plan: Action: click(start_box='(1,1)')</think>\nThought: go\nAction: wait()") == \
        ("go", [Action("wait", raw="wait()")])
    assert parse_response("<think>a</think> <think>b</think>Thought: t\nAction: wait()")[0] == "t"
    # the template opened <think> in the prompt: the answer starts inside it
    assert parse_response("still thinking</think>\n\nThought: t\nAction: wait()")[0] == "t"
    # an unclosed leading <think> loses its tag only: what follows still parses
    assert parse_response("<think>Thought: t\nAction: wait()")[0] == "t"
    # a </think> after the action is typed text, not reasoning
    assert one("Action: type(content='</think>')").content == "</think>"
    with pytest.raises(ParseError):
        parse_response("<think>Action: wait()</think>")   # nothing but reasoning


def test_unescaped_quotes_in_typed_text_are_recovered_as_ui_tars_does():
    t = "Thought: fill the title\nAction: type(content='Students', parents' and teachers' survey 2024\\n')"
    thought, (a,) = parse_response(t)
    assert thought == "fill the title"
    assert a.content == "Students', parents' and teachers' survey 2024\n" and a.submit
    assert one("finished(content='it's done, isn't it')").content == "it's done, isn't it"
    # the content runs to the last ') of the call: the next action on its own line is still an action
    _, acts = parse_response("Action: type(content='a', b')\n\ntype(content='c')\nAction: hotkey(key='enter')")
    assert [(x.type, x.content or x.key) for x in acts] == [("type", "a', b"), ("type", "c"), ("hotkey", "enter")]
    assert one("type(content='x') # a comment')").content == "x') # a comment"
    # other arguments keep the strict reading, and what follows the call must still be a call: errors, not guesses
    for bad in ("click(start_box='(1,2)', x')", "type(content='a', key='b')x", "type(content=__import__('os'))",
                "scroll(direction='up', start_box='(1,1)'); x')", "type(content='a') ; wait()"):
        with pytest.raises(ParseError):
            parse_response(bad)
    # code inside typed text stays text (nothing is ever evaluated)
    assert one("type(content='\\'); import os; os.system('rm')").content == "'); import os; os.system('rm"


def test_wrappers_are_dropped():
    assert one("```\nThought: x\nAction: wait()\n```").type == "wait"
    assert one("Action: finished()<|im_end|>").type == "finished"
    assert one("wait()[EOS]<|endoftext|>\n").type == "wait"


@pytest.mark.parametrize("text,reason", [
    ("", "empty"),
    ("   \n ", "empty"),
    ("Thought: nothing to do", "no 'Action:'"),
    ("Thought: x\nAction: ", "no action"),
    ("Action: open_app(app_name='Chrome')", "unknown action"),
    ("Action: press_home()", "unknown action"),
    ("click()", "needs"),
    ("drag(start_box='(1,2)')", "drag"),
    ("hotkey()", "hotkey"),
    ("hotkey(key='  ')", "hotkey"),
    ("type()", "content"),
    ("scroll(start_box='(1,2)')", "direction"),
    ("scroll(start_box='(1,2)', direction='sideways')", "direction"),
    ("click(start_box='(1,2)", "unterminated"),
    ("type(content='abc)", "unterminated"),
    ("type(content='abc\\", "unterminated"),
    ("click(start_box='(a,2)')", "bad coordinate"),
    ("click(start_box='(-1,2)')", "bad coordinate"),
    ("click(start_box='(1e3,2)')", "bad coordinate"),
    ("click(start_box='(nan,2)')", "bad coordinate"),
    ("click(start_box='(1,2,3)')", "2 numbers"),
    ("click(start_box='')", "2 numbers"),
    ("click(start_box='(" + "9" * 400 + ",1)')", "bad coordinate"),
    ("click(start_box=(1,2))", "quoted string"),
    ("click('(1,2)')", "argument name"),
    ("click(start_box='(1,2)', point='(1,2)')", "more than one"),
    ("click(start_box='(1,2)', start_box='(1,2)')", "twice"),
    ("click(start_box='(1,2)'", "expected ','"),
    ("click(start_box='(1,2)' target='x')", "bad coordinate"),   # the quote is read as text, then the point fails
    ("wait(content='x')", "unexpected argument"),
    ("click(start_box='(1,2)') trailing words", "unknown action 'trailing'"),
    ("click(start_box='(1,2)') wait", "expected '('"),
    ("Action: click start_box", "expected '('"),
    ("Action: 123", "expected an action"),
])
def test_errors(text, reason):
    with pytest.raises(ParseError) as e:
        parse_response(text)
    assert reason in str(e.value)
    assert len(str(e.value)) < 200


def test_non_string_input():
    with pytest.raises(ParseError):
        parse_response(None)  # type: ignore[arg-type]
    with pytest.raises(ParseError):
        parse_response(b"wait()")  # type: ignore[arg-type]


def test_format_action_is_the_parsers_inverse_and_actions_check_their_invariants():
    from actor.tiny import format_action
    from core.action import ActionError

    for a in (Action("click", target="Save"), Action("left_double", point=(12, 34)), Action("hotkey", key="ctrl c"),
              Action("type", content="it's a\\b\n"), Action("wait"), Action("finished"), Action("call_user")):
        assert one(format_action(a)).to_dict() == a.to_dict()
        assert Action.from_dict(a.to_dict()) == a
    for bad, why in (({"type": "teleport"}, "unknown action type"), ({"point": [1, 2]}, "needs a type"),
                     ({"type": "click", "point": [1, 2, 3]}, r"\[x, y\]"), ({"type": "click", "point": "12"}, r"\[x, y\]"),
                     ({"type": "click", "point": ["a", 1]}, "two numbers"), ({"type": "type", "content": 5}, "string"),
                     ({"type": "wait", "speed": "fast"}, "unknown action field"), ([], "JSON object")):
        with pytest.raises(ActionError, match=why):
            Action.from_dict(bad)


def test_action_types_match_envd():
    from core.action import ACTION_TYPES as CORE_TYPES  # what envd's backends receive
    assert ACTION_TYPES is CORE_TYPES


# ============================================================================ fuzzing and speed
_TOKENS = st.sampled_from([
    "Thought:", "Action:", "Action：", "\n", "\n\n", " ", "click", "left_double", "drag", "type", "scroll", "hotkey",
    "wait", "finished", "call_user", "foo", "(", ")", "'", '"', "\\", "\\'", "\\n", ",", "=", "start_box", "point",
    "end_box", "content", "key", "direction", "target", "<point>", "</point>", "<|box_start|>", "<|box_end|>",
    "<bbox>", "1", "23", "4.5", ".", "-", "up", "ctrl c", "北京", "```", "<|im_end|>", "[EOS]", "\x00", "\u2028",
])
_GRAMMARISH = st.lists(_TOKENS, max_size=40).map("".join)


def _check_any(text: str) -> None:
    try:
        thought, acts = parse_response(text)
    except ParseError as e:
        assert str(e)
        return
    assert isinstance(thought, str) and acts
    for a in acts:
        assert a.type in ACTION_TYPES
        d = a.to_dict()
        for k in ("point", "end_point"):
            if k in d:
                assert len(d[k]) == 2 and all(math.isfinite(v) and v >= 0 for v in d[k])
        json.dumps(d)


@settings(max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(), _GRAMMARISH, st.builds(lambda a, b: a + b, _GRAMMARISH, st.text(max_size=20))))
def test_fuzz_only_parse_errors(text):
    _check_any(text)


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from([c["text"] for c in FIXTURE["cases"]]), st.integers(0, 400), st.integers(0, 400),
       st.text(max_size=5))
def test_fuzz_mutated_real_outputs(text, i, j, ins):
    # Cut and splice real outputs: the realistic near-misses a policy produces.
    _check_any(text[:i] + ins + text[j:])
    _check_any(text[:i])


@pytest.mark.parametrize("adversarial", [
    "Action: type(content='" + "'" * 100_000,
    "Action: type(content='" + "' " * 50_000,
    "Action: type(content='" + "\\" * 100_000 + "')",
    "Action: click(start_box='(" + "1," * 50_000 + "')",
    "Action: click(start_box='(" + "1" * 100_000 + ",1)')",
    "Action: " + "wait()" * 16_000,
    "Action: " + "wait() " * 14_000 + "x",
    "Thought: " + "Action" * 16_000,
    "Thought: " + " " * 100_000 + "\n",
    "\n" * 100_000,
    " Action :" * 12_000,
    "click" * 20_000 + "(",
    "a" * 100_000,
    "((((" * 25_000,
    "wait()<|im_end|>" * 6_000,
    "[EOS]" * 20_000,
    "```" * 33_000,
    "Thought: x\n" + "\t" * 100_000 + "Action: wait()",
    "Action: type(content='" + "\\'" * 50_000 + "')",
    "<think>" * 15_000,
    "<think>" * 15_000 + "</think>Action: wait()",
    "</think>" * 12_000,
    "<think></think>" * 7_000 + "Action: wait()",
    "Action: " + "type(content='x') " * 6_000,
    "Action: type(content='" + "')" * 50_000,
    "Action: type(content='" + "')\n" * 35_000,
    "Action: finished(content='" + "', x='" * 20_000 + "')",
])
def test_adversarial_is_fast(adversarial):
    assert len(adversarial) >= 90_000
    t0 = time.perf_counter()
    _check_any(adversarial)
    assert time.perf_counter() - t0 < 1.0


# ============================================================================ coordinates
def test_smart_resize_known_values():
    assert smart_resize(1080, 1920) == (728, 1316)                        # Qwen2-VL default max_pixels
    assert smart_resize(1080, 1920, max_pixels=16384 * 28 * 28) == (1092, 1932)
    assert smart_resize(28, 28) == (56, 56)                                # min_pixels 56*56
    h, w = smart_resize(100, 3000)
    assert h % 28 == 0 and w % 28 == 0
    with pytest.raises(ValueError):
        smart_resize(10, 5000)                                             # aspect ratio > 200
    with pytest.raises(ValueError):
        smart_resize(0, 10)


@pytest.mark.parametrize("h,w", [(1080, 1920), (768, 1366), (2160, 3840), (1600, 2560), (600, 800), (2400, 1080),
                                 (50, 50), (1000, 9000), (333, 777)])
def test_smart_resize_properties(h, w):
    for mx in (14 * 14 * 4 * 1280, 16384 * 28 * 28):
        rh, rw = smart_resize(h, w, max_pixels=mx)
        assert rh % 28 == 0 and rw % 28 == 0
        assert 56 * 56 <= rh * rw <= mx
        assert abs(rw / rh - w / h) / (w / h) < 0.1


def test_to_screen_relative():
    assert to_screen((500, 500), "relative", 1920, 1080) == (960.0, 540.0)
    # The far edge of the model's range is the screen's last pixel, not one past it; beyond the range stays off.
    x, y = to_screen((0, 1000), "relative", 1920, 1080)
    assert x == 0.0 and y == pytest.approx(1080.0) and y < 1080
    assert to_screen((1000.5, 1001), "relative", 1000, 1000) == pytest.approx((1000.5, 1001))
    assert to_screen((912, 40), "relative", 2560, 1440) == pytest.approx((912 * 2.56, 40 * 1.44))


def test_to_screen_absolute():
    # 1920x1080 is resized to 1316x728 for the model: its pixel (658, 364) is the screen's centre.
    assert to_screen((658, 364), "absolute", 1920, 1080) == pytest.approx((960, 540))
    x, y = to_screen((1316, 728), "absolute", 1920, 1080)
    assert (x, y) == pytest.approx((1920, 1080)) and x < 1920 and y < 1080
    # A HiDPI screen whose screenshot is half size: the resize follows the image, the result the screen.
    rh, rw = smart_resize(1080, 1920)
    assert to_screen((rw / 4, rh / 4), "absolute", 3840, 2160, image_w=1920, image_h=1080) == pytest.approx((960, 540))
    assert to_screen((966, 546), "absolute", 1920, 1080, max_pixels=16384 * 28 * 28) == pytest.approx(
        (966 / 1932 * 1920, 546 / 1092 * 1080))
    with pytest.raises(ValueError):
        to_screen((1, 1), "pixels", 10, 10)


def test_on_screen_maps_both_points():
    a = on_screen(one("drag(start_box='(0,0)', end_box='(1000,500)')"), "relative", 800, 600)
    assert a.to_dict()["point"] == [0.0, 0.0] and a.to_dict()["end_point"] == [pytest.approx(800.0), 300.0]
    a.check_on_screen(800, 600)   # the far edge is on the screen
    assert on_screen(one("click(target='x')"), "absolute", 800, 600).point is None


def test_parse_point_forms():
    assert parse_point("<|box_start|>(1,2)<|box_end|>") == (1, 2)
    assert parse_point("<point>3.5 4</point>") == (3.5, 4)
    assert parse_point("(0,0,10,10)") == (5, 5)
    with pytest.raises(ParseError):
        parse_point("<point>1</point>")


# ============================================================================ prompts
@pytest.mark.parametrize("style", ["computer", "mobile", "browser", "COMPUTER_USE", "MOBILE_USE", "BROWSER"])
def test_system_prompt_layout(style):
    p = prompts.build_system_prompt(style, "Open the {weird} file", language="Chinese")
    assert p.startswith("You are a GUI agent. You are given a task and your action history, with screenshots.")
    assert "## Output Format\n```\nThought: ...\nAction: ...\n```" in p
    order = [p.index(h) for h in ("## Output Format", "## Action Space", "## Note", "## User Instruction")]
    assert order == sorted(order)
    assert p.rstrip().endswith("## User Instruction\nOpen the {weird} file")
    assert "Use Chinese in `Thought` part." in p
    assert "{language}" not in p and "{instruction}" not in p


@pytest.mark.parametrize("style", prompts.STYLES)
@pytest.mark.parametrize("form", ["box", "point"])
def test_action_space_lists_only_parseable_actions(style, form):
    text = prompts.action_space_text(style, point_form=form)
    names = [line.split("(", 1)[0] for line in text.splitlines()]
    assert set(names) <= set(ACTION_TYPES) and {"click", "type", "finished"} <= set(names)
    # Each example line, with numbers for the placeholders, must parse with our parser.
    for line in text.splitlines():
        call = line.split(" #", 1)[0]
        for ph, v in (("x1", "10"), ("y1", "20"), ("x2", "30"), ("y2", "40"), ("x3", "30"), ("y3", "40")):
            call = call.replace(ph, v)
        call = call.replace("down or up or right or left", "down")
        a = one(call)
        if form == "point" and a.point is not None:
            assert a.point == (10.0, 20.0)


def test_templates_are_exported():
    for t in (prompts.COMPUTER_USE, prompts.MOBILE_USE, prompts.BROWSER):
        assert "{instruction}" in t and "{language}" in t
    with pytest.raises(ValueError):
        prompts.build_system_prompt("tv", "x")
    with pytest.raises(ValueError):
        prompts.action_space_text("computer", point_form="pixels")


def test_history_window():
    turns = list("abcdefg")
    assert prompts.history_window(turns, 3) == [False] * 4 + [True] * 3
    assert prompts.history_window(turns, 0) == [False] * 7
    assert prompts.history_window(turns, -2) == [False] * 7
    assert prompts.history_window(turns, 99) == [True] * 7
    assert prompts.history_window([], 5) == []
    assert prompts.history_window(turns) == [False] * 2 + [True] * 5


def test_type_into_a_target_round_trips_with_free_text_content():
    """type may name the field it types into (our text-addressed extension, like click's target); the target goes
    first, because the content runs to the last "')" of the call."""
    from actor.tiny import format_action
    from core.action import Action

    for content in ("Michel", "it's", "Students', parents' and teachers'", "a\nb"):
        a = Action("type", content=content, target="[5]")
        text = format_action(a)
        assert text.startswith("type(target='[5]', content=")
        (b,) = parse_response(text)[1]
        assert (b.type, b.target, b.content) == ("type", "[5]", content)
    assert format_action(Action("type", content="x")) == "type(content='x')"   # no target: as before
    with pytest.raises(ParseError):
        parse_response("type(target='[5]')")                                      # still needs content


@pytest.mark.parametrize("content", ["a') type(b", "run f(x') wait(", "\\') click(", "it', target='x"])
def test_an_escaped_quote_never_ends_the_typed_text(content):
    """format_action escapes the typed text's quotes, and the parser reads them back whatever follows: an escaped
    "\\')" followed by a call on the same line, or "\\', target='", ended the text there (a ParseError, or the
    rest taken as a target)."""
    from actor.tiny import format_action
    from core.action import Action

    for target in ("", "[5]"):
        text = format_action(Action("type", content=content, target=target))
        (b,) = parse_response(text)[1]
        assert (b.content, b.target) == (content, target), text
    assert one("type(content='f(\\') wait(\\'x')").content == "f(') wait('x"
    a, w = parse_response("type(content='a\\\\') wait()")[1]     # an escaped backslash: the quote is real
    assert (a.content, w.type) == ("a\\", "wait")


@pytest.mark.parametrize("src, content, target", [
    ("type(content='ls\\n', target='terminal')", "ls\n", "terminal"),          # the order envd/hybrid.py documents
    ("type(content='alice', target='Name')", "alice", "Name"),
    ("type(content='it's', target = 'Name')", "it's", "Name"),                # an unescaped quote stays text
    ("type(target='Name', content='x', y')", "x', y", "Name"),
    ("type(content='a, target=b')", "a, target=b", ""),                        # not an argument: text
])
def test_a_target_after_the_typed_text_is_an_argument_not_text(src, content, target):
    a = one(src)
    assert (a.content, a.target) == (content, target)


def test_hotkey_and_wait_take_a_target_and_a_written_out_newline_submits():
    assert one("hotkey(key='ctrl c', target='terminal')").target == "terminal"
    assert one("wait(target='terminal')").target == "terminal"
    a = one("type(content='hello\\\\n')")           # the model wrote hello\\n: UI-TARS' executors press Enter
    assert a.content == "hello\n" and a.submit
    assert one("type(content='a\\\\nb')").content == "a\\nb"   # only at the end


def test_two_point_boxes_and_full_width_commas():
    assert parse_point("<|box_start|>(100,200),(300,400)<|box_end|>") == (200, 300)
    assert parse_point("(100,200),(300,400)") == (200, 300)
    assert parse_point("(100，200)") == (100, 200)
    assert one("click(start_box='<|box_start|>(100,200),(300,400)<|box_end|>')").point == (200, 300)


def test_a_second_call_on_the_same_line_as_type_is_a_second_action():
    _, acts = parse_response("Action: type(content='a') click(start_box='(1,2)')")
    assert [(x.type, x.content, x.point) for x in acts] == [("type", "a", None), ("click", "", (1, 2))]


def test_a_lone_surrogate_is_a_parse_error():
    with pytest.raises(ParseError, match="unicode"):
        parse_response("Action: type(content='\ud800')")
