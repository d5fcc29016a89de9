"""`games/<name>`: small HTML5 games in the browser backend, with a verifier and a controlled clock.

A game session is a browser session (envd/browser.py) on a page from envd/games/<name>.html (opened as file://)
that exposes:
  window.__tars_reset(seed)     restart the game deterministically from `seed`
  window.__tars_verify()        {score, level, lives, reward, done, clock_ms, ...}; reward = score gained since the
                                previous call, so the per-step rewards of an episode sum to its final score
  window.__tars_get_state() / window.__tars_set_state(s)   the whole game as JSON, for snapshot/fork
Beside each page, <name>.json holds its defaults (instruction, max_steps, step_ms, viewport) and the human reference
score used by evals.

Clock: game time is a fake clock (Playwright's page.clock: Date, performance.now, setTimeout/setInterval,
requestAnimationFrame and idle callbacks are replaced in the page before its scripts run). It stands still while
the agent thinks; each step applies the action, then runs exactly `step_ms` of game time (clock.run_for), firing
every timer that falls inside it back to back, so a step takes far less wall time than it simulates.

Why not CDP virtual time (Emulation.setVirtualTimePolicy): in Chromium 156's headless mode, which has no
BeginFrame control, pausing virtual time also stalls the frame pipeline. Measured here: a screenshot after a DOM
change hangs unless a frame happened to be produced during the preceding advance (timing-dependent), and mouse-move
and wheel input (delivered at animation frames) hang while paused. The fake clock leaves rendering and input alone.
What it does not control: CSS animations and transitions, media, and timers inside workers run in real time (the
games here use none of them).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

from envd.browser import BrowserEnv
from envd.browser_input import BrowserOptions, Checked, int_in

GAMES_DIR = pathlib.Path(__file__).with_name("games")
CLOCK_START_S = 1_735_689_600  # 2025-01-01 00:00 UTC; games start paused at 01:00 that day, every session
# Options a game session may set beyond step_ms; url, html, verify_js and the real-time waits belong to the game.
_GAME_OPTIONS = ("width", "height", "format", "quality", "instruction", "max_steps", "max_text_chars", "boxes",
                 "timeout_s")


def names() -> list[str]:
    """The games present: every envd/games/<name>.html with its <name>.json beside it."""
    return sorted(p.stem for p in GAMES_DIR.glob("*.html") if p.with_suffix(".json").is_file())


@functools.lru_cache(maxsize=None)
def game_info(name: str) -> dict:
    """The game's <name>.json: instruction, max_steps, step_ms, width, height, human_score, ..."""
    if name not in names():
        raise KeyError(f"unknown env id 'games/{name}': games are {names()}")
    return json.loads(GAMES_DIR.joinpath(f"{name}.json").read_text())


def parse_options(name: str, raw: dict[str, str]) -> tuple[BrowserOptions, int]:
    """(the browser options of game `name`'s page, step_ms) from a session's options over the game's defaults: the
    one parser of the factory, Reset, restore and registry.check_options. ValueError names a bad or unknown option;
    KeyError: no such game. Nothing is started."""
    info = game_info(name)
    bad = sorted(set(raw) - set(_GAME_OPTIONS) - {"step_ms"})
    if bad:
        raise ValueError(f"option(s) {bad} do not apply to games; they take step_ms and {list(_GAME_OPTIONS)}")
    try:
        step_ms = int_in(1, 60_000)(raw.get("step_ms", info.get("step_ms", 100)))
    except ValueError as e:
        raise ValueError(f"option step_ms: {e}") from None
    defaults = {k: str(info[k]) for k in ("instruction", "max_steps", "width", "height") if k in info}
    opts = BrowserOptions.parse({**defaults, **{k: v for k, v in raw.items() if k != "step_ms"}})
    return dataclasses.replace(opts, url=GAMES_DIR.joinpath(f"{name}.html").resolve().as_uri(),
                               verify_js="window.__tars_verify()", settle_ms=0, wait_ms=0), step_ms


class GameEnv(BrowserEnv):
    action_space = ("hotkey(key='up'|'down'|'left'|'right'|...), click/left_double/right_single(point=[x,y] | "
                    "target=LABEL), drag(point, end_point), type(content), scroll(point, direction), wait(), "
                    "finished()")
    restores_url = False

    def __init__(self, name: str, options: dict[str, str] | None = None, host=None):
        self.game = name
        self.info = game_info(name)
        self.env_id = self.snapshot_kind = f"games/{name}"
        self.step_ms = int(self.info.get("step_ms", 100))
        super().__init__(options, host)

    def _options(self, raw: dict[str, str]) -> BrowserOptions:
        opts, self.step_ms = parse_options(self.game, raw)
        return opts

    async def _before_load(self, page) -> None:
        # Installed before the page's scripts run, and paused from the start: no game time passes while loading.
        # The installed clock runs in real time until paused, and pause_at may not go back in time: pause an hour
        # ahead so that no delay between the two calls can put the target in the past.
        await page.clock.install(time=CLOCK_START_S)
        await page.clock.pause_at(CLOCK_START_S + 3600)

    async def _prepare(self, seed: int, snap: dict | None) -> None:
        # Restart the game now that the clock stands still: its timers start at the same phase whatever happened
        # in real time while the page loaded; a snapshot's state then replaces the fresh game.
        await self.page.evaluate("seed => window.__tars_reset(seed)", seed & 0x7FFFFFFF)
        await super()._prepare(seed, snap)

    async def _act_and_settle(self, c: Checked) -> None:
        point = await self._point(c.action)  # a bad target fails here, before any input or game time
        await self._input(c, point)
        await self.advance_clock(self.step_ms)

    async def advance_clock(self, ms: int) -> None:
        """Run exactly `ms` of game time (every timer due inside it fires), then stand still again."""
        await self.page.clock.run_for(ms)

    def game_state(self) -> dict:
        """The game's own state (window.__tars_get_state()), read without side effects (no reward consumed)."""
        return self._call(self._game_state)

    async def _game_state(self) -> dict:
        self._check_alive()
        return await self.page.evaluate("window.__tars_get_state()")


def make(name: str, options: dict[str, str]) -> GameEnv:
    """Registry factory for env ids `games/<name>`."""
    if not name:
        raise KeyError(f"env id 'games' needs a game name: games/<name> for a name in {names()}")
    return GameEnv(name, options)
