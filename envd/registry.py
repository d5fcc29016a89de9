"""Env id -> backend resolution.

An env id is `<prefix>/<name>` (or a bare `<prefix>`): `builtin/click`, later `gym/CartPole-v1`,
`miniwob/click-button`, `browser`, ... Each prefix maps to a factory `(name, options) -> Env`. The longest
registered prefix wins, so `miniwob/v2` can override part of `miniwob`.

Backends are imported lazily inside their factory: a daemon that never serves browsers must not need playwright,
and a broken optional backend must not stop the others from loading.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable

from envd.base import Env

Factory = Callable[[str, dict[str, str]], Env]
Names = Callable[[], Iterable[str]]

_lock = threading.Lock()  # factories run in worker threads; registration may happen at any time
_factories: dict[str, tuple[Factory, Names | None]] = {}


def register(prefix: str, factory: Factory, names: Iterable[str] | Names | None = None) -> None:
    """Serve env ids under `prefix` with `factory(name, options)`.

    `names` lists the env names the backend offers (for ListEnvs): an iterable, a callable returning one (evaluated
    on every ListEnvs, so it may import lazily), or None when the set is open-ended. Registering a prefix again
    replaces the previous factory.
    """
    prefix = prefix.strip().strip("/")
    if not prefix:
        raise ValueError("an env prefix must not be empty")
    if names is not None and not callable(names):
        frozen = tuple(names)
        names = lambda: frozen  # noqa: E731
    with _lock:
        _factories[prefix] = (factory, names)


def unregister(prefix: str) -> None:
    with _lock:
        _factories.pop(prefix.strip().strip("/"), None)


def resolve(env_id: str) -> tuple[str, str, Factory]:
    """(prefix, name, factory) for an env id; KeyError when no prefix serves it."""
    env_id = env_id.strip()
    with _lock:
        table = dict(_factories)
    best = ""
    for prefix in table:
        if (env_id == prefix or env_id.startswith(prefix + "/")) and len(prefix) > len(best):
            best = prefix
    if not best:
        raise KeyError(f"unknown env id {env_id!r}: no backend serves it (known prefixes: {sorted(table)})")
    return best, env_id[len(best) + 1:], table[best][0]


# Backends that take a `workspace` option in-process (a host directory they would create and run programs in).
WORKSPACE_OPTION = ("desktop", "hybrid")


def make(env_id: str, options: dict[str, str] | None = None, *, remote: bool = False) -> Env:
    """A fresh Env for `env_id`. KeyError: unknown id; ValueError: bad options; anything else: backend failure.

    remote: asked over RPC (envd's CreateSession): never with a workspace the caller names (a directory envd would
    create and run programs in). Every backend is served: the desktop's and hybrid's GUI apps run in the sandbox."""
    prefix, name, factory = resolve(env_id)
    if remote and prefix in WORKSPACE_OPTION and (options or {}).get("workspace"):
        raise ValueError("the workspace option is not taken over RPC (envd would create and run programs in a "
                         "directory the caller names)")
    env = factory(name, dict(options or {}))
    if not isinstance(env, Env):
        raise TypeError(f"the factory for {env_id!r} returned {type(env).__name__}, not an envd.base.Env")
    if not env.env_id:
        env.env_id = env_id
    return env


def list_env_ids() -> list[str]:
    """Every concrete env id the registered backends announce (open-ended backends list just their prefix)."""
    with _lock:
        table = dict(_factories)
    out: list[str] = []
    for prefix, (_, names) in sorted(table.items()):
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


register("builtin", _builtin_factory, _builtin_names)


# ---- miniwob: the MiniWoB++ tasks on headless Chromium (envd/miniwob_backend.py) ----------------------------

def _miniwob_factory(task: str, options: dict[str, str]) -> Env:
    from envd import miniwob_backend

    return miniwob_backend.make(task, options)


def _miniwob_names() -> list[str]:
    from envd import miniwob_backend

    return miniwob_backend.task_names()


register("miniwob", _miniwob_factory, _miniwob_names)


# ---- desktop: an Xvfb desktop with real apps per session (envd/desktop.py) -----------------------------------

def _desktop_factory(name: str, options: dict[str, str]) -> Env:
    from envd import desktop

    return desktop.make(name, options)


register("desktop", _desktop_factory, [""])


def _terminal_factory(task: str, options: dict[str, str]) -> Env:
    from envd import terminal

    return terminal.make(task, options)


def _terminal_names() -> list[str]:
    from envd import terminal_tasks

    return ["", *terminal_tasks.TASKS]


register("terminal", _terminal_factory, _terminal_names)


def _gym_factory(name: str, options: dict[str, str]) -> Env:
    from envd import gym_backend

    return gym_backend.make(name, options)


def _gym_names() -> list[str]:
    from envd import gym_backend

    return gym_backend.env_names()


register("gym", _gym_factory, _gym_names)


def _hybrid_factory(task: str, options: dict[str, str]) -> Env:
    from envd import hybrid

    return hybrid.make(task, options)


def _hybrid_names() -> list[str]:
    from envd import terminal_tasks

    return ["", *terminal_tasks.TASKS]


register("hybrid", _hybrid_factory, _hybrid_names)


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


register("browser", _browser_factory, [""])
register("games", _games_factory, _games_names)
