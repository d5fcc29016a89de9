"""Which gymnasium environments can be made here: the ids of gymnasium's registry whose entry point imports (the
`gym/<id>` backend's ListEnvs set, envd/gym_backend.py).

Whether a module entry point imports is asked of a child Python: importing one runs its packages' __init__, and
gymnasium's phys2d and tabular families import JAX and flax there, whose first array takes 75 % of every GPU it sees
(seen on an H200: 108 GB held by `tars up`, which lists them in its checks, before any model loaded). The child sees
no GPU.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

_PROBE = """
import importlib.util, json, sys
req = json.load(sys.stdin)
sys.path[:] = req["path"]
ok = []
for m in req["modules"]:
    try:
        if importlib.util.find_spec(m) is not None:
            ok.append(m)
    except Exception:  # a parent package failing to import (no mujoco, box2d) means "not here"
        pass
print(json.dumps(ok))
"""
PROBE_TIMEOUT_S = 120.0


@functools.lru_cache(maxsize=8)
def _importable(modules: frozenset[str]) -> frozenset[str]:
    """The modules of `modules` that import here, found in a child process without a GPU (CUDA_VISIBLE_DEVICES and
    JAX_PLATFORMS hide it); RuntimeError naming the child's error when it fails or outlasts PROBE_TIMEOUT_S."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    req = json.dumps({"path": sys.path, "modules": sorted(modules)})
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], input=req, capture_output=True, text=True, env=env,
                           timeout=PROBE_TIMEOUT_S)
        if r.returncode == 0:
            return frozenset(json.loads(r.stdout.strip().splitlines()[-1]))
        why = f"exit {r.returncode}: {r.stderr.strip()[-500:]}"
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        why = f"{type(e).__name__}: {e}"
    raise RuntimeError(f"cannot tell which gymnasium environments import here: the probe {why}")


def env_names() -> list[str]:
    """Registered gymnasium ids whose entry point imports here (mujoco, box2d, ... may be missing). Callable entry
    points count as importable; module entry points are checked in a child process (_importable), so this process
    imports none of them."""
    import gymnasium

    specs = sorted(gymnasium.registry.items())
    module = {env_id: ep.split(":")[0] for env_id, spec in specs
              if isinstance(ep := spec.entry_point, str) and ":" in ep}
    ok = _importable(frozenset(module.values()))
    return [env_id for env_id, spec in specs if callable(spec.entry_point) or module.get(env_id) in ok]
