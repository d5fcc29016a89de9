"""The envd session option every backend takes, known to the daemon (envd.base, envd.registry), the actor and the
run's config checks alike: one parser.

    screenshots   1 (the default) or 0 (also true/false, yes/no, on/off): 0 = the session's observations carry no
                  screenshot, and a backend that captures them skips the capture (for a text policy a screenshot costs
                  the browser a render and the stream its bytes on every step, for nothing it reads)
"""
from __future__ import annotations

SCREENSHOTS = "screenshots"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def split_screenshots(options: dict[str, str]) -> tuple[dict[str, str], bool]:
    """(the backend's options, whether observations carry screenshots): the `screenshots` option taken out.
    ValueError for a value that is not one of the forms above."""
    if SCREENSHOTS not in options:
        return options, True
    rest = dict(options)
    v = str(rest.pop(SCREENSHOTS)).strip().lower()
    if v in _ON or v in _OFF:
        return rest, v in _ON
    raise ValueError(f"{SCREENSHOTS}={options[SCREENSHOTS]!r}: expected 1 or 0")
