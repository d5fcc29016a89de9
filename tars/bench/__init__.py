"""Benchmarks: each measures one role or several and reports ratios to a baseline measured in the same run.

`tars bench NAME ARGS...`: each benchmark parses its own arguments (`tars bench NAME --help`), so building the
top-level parser imports none of them. `tars bench all` runs every entry here (looked up when it runs).
"""
from __future__ import annotations

import importlib

# name -> module under tars.bench whose main(argv) runs it; `async` runs last in `tars bench all` (the headline).
BENCHES: dict[str, str] = {"actor": "actor", "env": "envd", "faults": "faults", "inference": "inference",
                           "learner": "learner", "soak": "soak", "corrections": "corrections", "async": "async_rl",
                           "all": "all"}


def run_bench(name: str, argv: list[str]) -> int:
    """Import tars.bench.<module> for NAME and run its main(argv)."""
    return importlib.import_module(f"tars.bench.{BENCHES[name]}").main(argv)


def report(out: dict, table, json_path: str | None) -> int:
    """A benchmark's end: its figures to json_path when given, its table to stdout; exit status 0."""
    if json_path:
        import json

        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
    print(table(out))
    return 0
