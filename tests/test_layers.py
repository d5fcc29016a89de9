"""The floor plan, checked like a test: import-linter's contracts (pyproject.toml) and the module-size rule.

Floors: core (ground) <- envd | inference_server | actor | learner (roles, independent) <- tars (operations).
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("core", "envd", "inference_server", "actor", "learner", "tars")
MAX_LINES = 450


def _lint_imports() -> str | None:
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    return str(exe) if exe.exists() else shutil.which("lint-imports")


def test_import_contracts_hold():
    """Imports point down only, the four roles never import each other, and no package has an import circle."""
    exe = _lint_imports()
    if exe is None:
        pytest.skip("import-linter is not installed (scripts/setup.sh --dev installs it)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([exe, "--no-cache"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_contracts_name_every_package():
    """A new top-level package must be placed on a floor, or the contracts silently ignore it."""
    text = (REPO / "pyproject.toml").read_text()
    for pkg in PACKAGES:
        assert f'"{pkg}' in text.split("[tool.importlinter]", 1)[1], pkg
    found = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert found <= set(PACKAGES), f"packages outside the floor plan: {sorted(found - set(PACKAGES))}"


def test_no_module_is_too_long():
    """Modules stay readable top to bottom: at most ~450 lines, generated code aside."""
    long = []
    for pkg in PACKAGES:
        for f in (REPO / pkg).rglob("*.py"):
            if "v1" in f.relative_to(REPO).parts:
                continue  # protoc's output
            n = len(f.read_text().splitlines())
            if n > MAX_LINES:
                long.append(f"{f.relative_to(REPO)}: {n}")
    assert not long, long
