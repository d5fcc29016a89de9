"""The browser backend's pure parts: options, URL policy, key names, action checks (no browser needed)."""
from __future__ import annotations

import pytest

from envd.base import Action, ActionError
from envd.browser_input import BrowserOptions, check_action, check_url, playwright_keys, url_allowed


def test_options_defaults_and_parsing():
    o = BrowserOptions.parse({})
    assert (o.width, o.height, o.format, o.allow_any_url, o.max_steps) == (1280, 720, "png", False, 50)
    o = BrowserOptions.parse({"width": "800", "height": "600", "format": "JPG", "quality": "55", "boxes": "yes",
                              "url": "http://127.0.0.1:8000/x", "timeout_s": "5"})
    assert (o.width, o.height, o.format, o.quality, o.boxes, o.timeout_s) == (800, 600, "jpeg", 55, True, 5.0)


@pytest.mark.parametrize("options, match", [
    ({"width": "wide"}, "width: not an integer"),
    ({"width": "10"}, r"width: 10 is outside"),
    ({"format": "gif"}, "format"),
    ({"quality": "0"}, "quality"),
    ({"boxes": "maybe"}, "boxes: not a boolean"),
    ({"timeout_s": "nan"}, "timeout_s"),
    ({"colour": "red"}, r"unknown option\(s\) \['colour'\]"),
    ({"url": "http://127.0.0.1/", "html": "<p>x</p>"}, "not both"),
    ({"url": "https://example.com/"}, "not on loopback"),
    ({"url": "javascript:alert(1)"}, "only http"),
    ({"url": "chrome://settings"}, "only http"),
])
def test_bad_options_name_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        BrowserOptions.parse(options)


def test_allow_any_url_opens_other_hosts():
    assert BrowserOptions.parse({"url": "https://example.com/", "allow_any_url": "1"}).url == "https://example.com/"


@pytest.mark.parametrize("url, ok", [
    ("http://127.0.0.1:9/a", True), ("https://localhost/", True), ("http://[::1]:80/", True),
    ("http://127.8.9.10/", True), ("file:///tmp/x.html", True), ("data:text/html,hi", True), ("about:blank", True),
    ("http://example.com/", False), ("http://10.0.0.1/", False), ("http://localhost.evil.com/", False),
    ("ws://example.com/", False), ("ftp://127.0.0.1/", False), ("http://[::1", False),
])
def test_url_policy(url, ok):
    assert url_allowed(url, False) is ok


def test_any_url_still_refuses_odd_schemes_at_top_level():
    with pytest.raises(ValueError):
        check_url("chrome://version", True, top_level=True)
    check_url("https://example.com/", True, top_level=True)


@pytest.mark.parametrize("key, chord", [
    ("ctrl a", "Control+a"), ("ctrl+shift+t", "Control+Shift+t"), ("shift ctrl t", "Shift+Control+t"),
    ("a ctrl", "Control+a"), ("enter", "Enter"), ("Up", "ArrowUp"), ("arrowleft", "ArrowLeft"), ("esc", "Escape"),
    ("space", "Space"), ("cmd c", "Meta+c"), ("f5", "F5"), ("pagedown", "PageDown"), ("+", "+"), ("ctrl plus", "Control++"),
])
def test_hotkey_names(key, chord):
    assert playwright_keys(key) == chord


@pytest.mark.parametrize("key", ["", "  ", "ctrl hyperdrive", "a b", "ctrl \x07",
                                 "é", "ctrl ü", "€"])   # not in Playwright's layout: its Error was an INFRA_ERROR
def test_bad_hotkeys(key):
    with pytest.raises(ActionError):
        playwright_keys(key)


def test_check_action_normalises_and_rejects():
    a = check_action(Action("click", point=[10, "20"]), 100, 50)
    assert a.action.point == (10.0, 20.0)
    assert check_action(Action("hotkey", key="ctrl a"), 100, 50).keys == "Control+a"
    assert check_action(Action("hotkey", content="enter"), 100, 50).keys == "Enter"  # key in content
    assert check_action(Action("scroll", direction="DOWN"), 100, 50).action.direction == "down"
    assert check_action(Action("click", target="OK"), 100, 50).action.target == "OK"
    for bad, match in [
        ({"type": "teleport"}, "unknown action type"),
        ({"type": "click"}, "needs a point"),
        ({"type": "click", "point": [100, 10]}, "outside the 100x50 viewport"),
        ({"type": "click", "point": [-1, 10]}, "outside"),
        ({"type": "click", "point": [float("nan"), 10]}, "finite"),   # refused by the Action type itself
        ({"type": "click", "point": [1]}, r"must be \[x, y\]"),
        ({"type": "click", "point": ["a", 1]}, "two numbers"),
        ({"type": "drag", "point": [1, 1]}, "end_point"),
        ({"type": "drag", "point": [1, 1], "end_point": [1, 99]}, "end_point"),
        ({"type": "type"}, "needs non-empty content"),
        ({"type": "type", "content": "x" * 4097}, "4097 characters; at most 4096"),
        ({"type": "scroll", "direction": "sideways"}, "direction"),
        ({"type": "hotkey"}, "needs a key"),
    ]:
        with pytest.raises(ActionError, match=match):
            check_action(Action(**bad), 100, 50)
