"""Generate Python code for proto/tars/v1/*.proto into core/v1/, or check that it is in sync.

    python scripts/gen_proto.py          # regenerate
    python scripts/gen_proto.py --check  # exit 1 if core/v1/ differs from what the protos give

The wire package stays `tars.v1` (service names such as tars.v1.EnvService, the files' names in the descriptor
pool); the Python modules live in the ground-floor package `core`, so protoc's `from tars.v1 import ...` lines and
the path in its version notice are rewritten to `core.v1` / `core/v1/` after generation.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
OUT = ROOT / "core" / "v1"


def _relocate(text: str) -> str:
    text = re.sub(r"^from tars\.v1 import ", "from core.v1 import ", text, flags=re.M)
    return text.replace("generated code in tars/v1/", "generated code in core/v1/")


def generate() -> dict[str, str]:
    """{file name: text} of the generated modules, already relocated to core.v1."""
    from grpc_tools import protoc
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = sorted(str(p.relative_to(PROTO)) for p in (PROTO / "tars" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", *files]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        return {f.name: _relocate(f.read_text()) for f in sorted((pathlib.Path(tmp) / "tars" / "v1").iterdir())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    gen = generate()
    if not a.check:
        OUT.mkdir(parents=True, exist_ok=True)
        for name, text in gen.items():
            (OUT / name).write_text(text)
        (OUT / "__init__.py").touch()
        return 0
    bad = [name for name, text in gen.items() if not (OUT / name).exists() or (OUT / name).read_text() != text]
    if bad:
        print("out of sync with proto/: " + ", ".join(bad) + " (run python scripts/gen_proto.py)")
        return 1
    print("generated code in sync")
    return 0


if __name__ == "__main__":
    sys.exit(main())
