"""Does this host bound a sandbox's memory? envd.cgroups as `envd.memory_cgroups=auto` sets it up: where the cgroups
go, then a process that touches 200 MiB in a 64 MiB cgroup (the kernel should kill it) and one of 20 MiB (it should
exit 0). From the repository root: python scripts/cgroup_check.py"""
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from envd import cgroups as c  # noqa: E402

print("cgroups:", c.configure("auto"))
g = c.memory_cgroup(64)
print("made", g and g.path)
if g:
    r = subprocess.run(g.argv() + [sys.executable, "-c", "b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096])"])
    print("200 MiB under 64 MiB: rc", r.returncode, "oom_kills", g.oom_kills(), "peak_mb", round(g.peak_mb(), 1))
    r = subprocess.run(g.argv() + [sys.executable, "-c", "b = bytearray(20 << 20)"])
    print("20 MiB under 64 MiB: rc", r.returncode)
    print("closed", g.close())
