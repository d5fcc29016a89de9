"""scripts/offline_bundle.sh: the libraries it bundles for a host without network are every one that MiniWoB's host
programs load, glibc's excepted (a first pack left out socat's five; that machine's envd could not start a session)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROGRAMS = ["/usr/lib/chromium/chromium", "/usr/bin/chromedriver", "/usr/bin/bwrap", "/usr/bin/socat"]

pytestmark = pytest.mark.skipif(
    not shutil.which("dpkg") or not all(pathlib.Path(p).exists() for p in PROGRAMS),
    reason="needs a Debian host with chromium, chromium-driver, bubblewrap and socat (scripts/setup.sh --dev)")


def _needed(program: str) -> set[str]:
    out = subprocess.run(["ldd", program], capture_output=True, text=True, check=True, timeout=60).stdout
    return {line.split("=>")[1].split()[0] for line in out.splitlines() if "=> /" in line}


def _glibc(lib: str) -> bool:
    real = str(pathlib.Path(lib).resolve())
    for path in (real, lib):
        r = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            return r.stdout.split(":")[0] == "libc6"
    return False


def test_every_library_the_programs_load_is_bundled_or_glibcs():
    r = subprocess.run(["bash", str(ROOT / "scripts/offline_bundle.sh"), "libs"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    bundled = set(r.stdout.split())
    for program in PROGRAMS:
        missing = {lib for lib in _needed(program) - bundled if not _glibc(lib)}
        assert not missing, f"{program} loads {sorted(missing)}, which the bundle leaves out"
    assert not {lib for lib in bundled if _glibc(lib)}, "glibc's own libraries are the target's, not bundled"


def test_a_verb_is_required():
    r = subprocess.run(["bash", str(ROOT / "scripts/offline_bundle.sh"), "unpack", "x"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "usage: offline_bundle.sh pack OUTDIR" in r.stderr
