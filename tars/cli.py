"""The `tars` command."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("tars: under construction", file=sys.stderr)
    return 2
