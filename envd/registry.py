"""Env id -> backend resolution.

An env id is `<prefix>/<name>` (or a bare `<prefix>`): `builtin/click`, later `gym/CartPole-v1`,
`miniwob/click-button`, `browser`, ... Each prefix maps to a factory `(name, options) -> Env`. The longest
registered prefix wins, so `miniwob/v2` can override part of `miniwob`.

A backend may also register an option checker `(name, options) -> None`: pure parsing (it starts nothing) that
raises ValueError naming a bad or unknown option and the known ones, the very parser its factory and reset use.
`check_options` runs it, so `tars up` / `tars eval` refuse a typo in actor.env_options or a suite's options before
any daemon or browser starts (every built-in backend has one and refuses option names it does not know).
And the host programs it needs (`needs() -> the missing ones`): `missing_programs`, so `tars up`, which runs envd on
its own host, says that chromium or bubblewrap is not installed before anything starts, not at the first session.

Backends are imported lazily inside their factory: a daemon that never serves browsers must not need playwright,
and a broken optional backend must not stop the others from loading.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable

from core.session_options import split_screenshots
from envd.base import Env

Factory = Callable[[str, dict[str, str]], Env]
Names = Callable[[], Iterable[str]]
Checker = Callable[[str, dict[str, str]], None]

_lock = threading.Lock()  # factories run in worker threads; registration may happen at any time
_factories: dict[str, tuple[Factory, Names | None, Checker | None]] = {}
_needs: dict[str, Callable[[], list[str]]] = {}


def register(prefix: str, factory: Factory, names: Iterable[str] | Names | None = None,
             options: Checker | None = None, needs: Callable[[], list[str]] | None = None) -> None:
    """Serve env ids under `prefix` with `factory(name, options)`.

    `names` lists the env names the backend offers (for ListEnvs): an iterable, a callable returning one (evaluated
    on every ListEnvs, so it may import lazily), or None when the set is open-ended. `options`: the backend's option
    checker `(name, options) -> None` (see the module docstring); None: its options are not checked ahead.
    `needs`: `() -> [host programs the backend needs that are missing]` (None: none). Registering a prefix again
    replaces the previous factory.
    """
    prefix = prefix.strip().strip("/")
    if not prefix:
        raise ValueError("an env prefix must not be empty")
    if names is not None and not callable(names):
        frozen = tuple(names)
        names = lambda: frozen  # noqa: E731
    with _lock:
        _factories[prefix] = (factory, names, options)
        _needs.pop(prefix, None)
        if needs is not None:
            _needs[prefix] = needs


def unregister(prefix: str) -> None:
    with _lock:
        _factories.pop(prefix.strip().strip("/"), None)


def _lookup(env_id: str) -> tuple[str, str, tuple[Factory, Names | None, Checker | None]]:
    env_id = env_id.strip()
    with _lock:
        table = dict(_factories)
    best = ""
    for prefix in table:
        if (env_id == prefix or env_id.startswith(prefix + "/")) and len(prefix) > len(best):
            best = prefix
    if not best:
        raise KeyError(f"unknown env id {env_id!r}: no backend serves it (known prefixes: {sorted(table)})")
    return best, env_id[len(best) + 1:], table[best]


def missing_programs(env_id: str) -> list[str]:
    """The host programs the backend of `env_id` needs that are not installed here ([] when none); KeyError when
    no prefix serves it."""
    prefix = _lookup(env_id)[0]
    with _lock:
        needs = _needs.get(prefix)
    return list(needs()) if needs is not None else []


def resolve(env_id: str) -> tuple[str, str, Factory]:
    """(prefix, name, factory) for an env id; KeyError when no prefix serves it."""
    prefix, name, entry = _lookup(env_id)
    return prefix, name, entry[0]


def check_options(env_id: str, options: dict[str, str] | None = None, *, remote: bool = False) -> None:
    """What the backend of `env_id` would refuse of these session options, found without creating anything:
    ValueError naming the bad option (and the known ones); KeyError for an id no backend serves (as resolve).
    A backend registered without a checker is not checked. remote: options a CreateSession would carry, so the
    daemon's own `hint_policy` is taken out (and checked) and a `workspace` is refused as make(remote=True) does."""
    prefix, name, (_, _, checker) = _lookup(env_id)
    opts = split_screenshots({str(k): str(v) for k, v in (options or {}).items()})[0]
    if remote:
        from envd import hints

        opts, hint = hints.split_options(opts)
        if hint:
            hints.check(hint)
        _remote_rules(prefix, opts)
    if checker is not None:
        checker(name, opts)


def _remote_rules(prefix: str, options: dict[str, str]) -> None:
    if prefix in WORKSPACE_OPTION and options.get("workspace"):
        raise ValueError("the workspace option is not taken over RPC (envd would create and run programs in a "
                         "directory the caller names)")


# Backends that take a `workspace` option in-process (a host directory they would create and run programs in).
WORKSPACE_OPTION = ("desktop", "hybrid")


def make(env_id: str, options: dict[str, str] | None = None, *, remote: bool = False) -> Env:
    """A fresh Env for `env_id`. KeyError: unknown id; ValueError: bad options; anything else: backend failure.

    remote: asked over RPC (envd's CreateSession): never with a workspace the caller names (a directory envd would
    create and run programs in). Every backend is served: the desktop's and hybrid's GUI apps run in the sandbox.
    The option every backend takes, `screenshots` (core.session_options), is taken out here and set on the env."""
    prefix, name, factory = resolve(env_id)
    options, screenshots = split_screenshots(dict(options or {}))
    if remote:
        _remote_rules(prefix, options)
    env = factory(name, options)
    if not isinstance(env, Env):
        raise TypeError(f"the factory for {env_id!r} returned {type(env).__name__}, not an envd.base.Env")
    env.screenshots = screenshots   # before its first Reset: a backend reads it when it observes
    if not env.env_id:
        env.env_id = env_id
    return env


def list_env_ids() -> list[str]:
    """Every concrete env id the registered backends announce (open-ended backends list just their prefix)."""
    with _lock:
        table = dict(_factories)
    out: list[str] = []
    for prefix, (_, names, _) in sorted(table.items()):
        if names is None:
            out.append(prefix)
            continue
        try:
            out.extend(f"{prefix}/{n}" if n else prefix for n in names())
        except ImportError:
            continue  # an optional backend that is not installed offers nothing
    return out


# ---- built-in backends ------------------------------------------------------------------------------------

def _builtin_factory(task: str, options: dict[str, str]) -> Env:
    from envd import builtin

    if task not in builtin.TASKS:
        raise KeyError(f"unknown env id 'builtin/{task}': builtin tasks are {list(builtin.TASKS)}")
    return builtin.make(task, options)


def _builtin_names() -> list[str]:
    from envd import builtin

    return list(builtin.TASKS)


def _builtin_options(task: str, options: dict[str, str]) -> None:
    from envd import builtin

    builtin.parse_options(options)


register("builtin", _builtin_factory, _builtin_names, _builtin_options)


# ---- miniwob: the MiniWoB++ tasks on headless Chromium (envd/miniwob_backend.py) ----------------------------

def _miniwob_factory(task: str, options: dict[str, str]) -> Env:
    from envd import miniwob_backend

    return miniwob_backend.make(task, options)


def _miniwob_names() -> list[str]:
    from envd import miniwob_backend

    return miniwob_backend.task_names()


def _miniwob_options(task: str, options: dict[str, str]) -> None:
    from envd import miniwob_backend

    miniwob_backend.parse_options(options)


def _miniwob_needs() -> list[str]:
    from envd import miniwob_chromium

    return miniwob_chromium.missing()


register("miniwob", _miniwob_factory, _miniwob_names, _miniwob_options, _miniwob_needs)


# ---- desktop: an Xvfb desktop with real apps per session (envd/desktop.py) -----------------------------------

def _desktop_factory(name: str, options: dict[str, str]) -> Env:
    from envd import desktop

    return desktop.make(name, options)


def _desktop_options(name: str, options: dict[str, str]) -> None:
    from envd import desktop

    desktop.parse_options(options)


def _desktop_needs() -> list[str]:
    from envd import desktop
    from envd.sandbox_limits import missing_tools

    return missing_tools() + desktop.missing_x_tools()


register("desktop", _desktop_factory, [""], _desktop_options, _desktop_needs)


def _terminal_factory(task: str, options: dict[str, str]) -> Env:
    from envd import terminal

    return terminal.make(task, options)


def _terminal_names() -> list[str]:
    from envd import terminal_tasks

    return ["", *terminal_tasks.TASKS]


def _terminal_options(task: str, options: dict[str, str]) -> None:
    from envd import terminal

    terminal.check_options(task, options)


def _terminal_needs() -> list[str]:
    from envd.sandbox_limits import missing_tools

    return missing_tools()


register("terminal", _terminal_factory, _terminal_names, _terminal_options, _terminal_needs)


def _gym_factory(name: str, options: dict[str, str]) -> Env:
    from envd import gym_backend

    return gym_backend.make(name, options)


def _gym_names() -> list[str]:
    from envd import gym_names

    return gym_names.env_names()


def _gym_options(name: str, options: dict[str, str]) -> None:
    from envd import gym_backend

    gym_backend.parse_options(options)


register("gym", _gym_factory, _gym_names, _gym_options)


def _hybrid_factory(task: str, options: dict[str, str]) -> Env:
    from envd import hybrid

    return hybrid.make(task, options)


def _hybrid_names() -> list[str]:
    from envd import terminal_tasks

    return ["", *terminal_tasks.TASKS]


def _hybrid_options(task: str, options: dict[str, str]) -> None:
    from envd import hybrid

    hybrid.check_options(task, options)


register("hybrid", _hybrid_factory, _hybrid_names, _hybrid_options, _desktop_needs)  # the terminal's are in it


# ---- browser and games (envd/browser.py, envd/games.py) ----------------------------------------------------------

def _browser_factory(name: str, options: dict[str, str]) -> Env:
    from envd import browser

    return browser.make(name, options)


def _games_factory(name: str, options: dict[str, str]) -> Env:
    from envd import games

    return games.make(name, options)


def _games_names() -> list[str]:
    from envd import games

    return games.names()


def _browser_options(name: str, options: dict[str, str]) -> None:
    from envd.browser_input import BrowserOptions

    BrowserOptions.parse(options)


def _games_options(name: str, options: dict[str, str]) -> None:
    from envd import games

    games.parse_options(name, options)


def _browser_needs() -> list[str]:
    import os

    from envd.browser_host import CHROMIUM

    return [] if os.path.exists(CHROMIUM) else [CHROMIUM]


register("browser", _browser_factory, [""], _browser_options, _browser_needs)
register("games", _games_factory, _games_names, _games_options, _browser_needs)
