"""Generate Python code for proto/tars/v1/*.proto into tars/v1/, or check that it is in sync.

    python scripts/gen_proto.py          # regenerate
    python scripts/gen_proto.py --check  # exit 1 if tars/v1/ differs from what the protos give
"""
from __future__ import annotations

import argparse
import filecmp
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"


def generate(out: pathlib.Path) -> None:
    from grpc_tools import protoc
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = sorted(str(p.relative_to(PROTO)) for p in (PROTO / "tars" / "v1").glob("*.proto"))
    args = ["protoc", f"-I{PROTO}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    if not a.check:
        generate(ROOT)
        (ROOT / "tars" / "v1" / "__init__.py").touch()
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        gen = pathlib.Path(tmp) / "tars" / "v1"
        bad = []
        for f in sorted(gen.iterdir()):
            have = ROOT / "tars" / "v1" / f.name
            if not have.exists() or not filecmp.cmp(f, have, shallow=False):
                bad.append(f.name)
        if bad:
            print("out of sync with proto/: " + ", ".join(bad) + " (run python scripts/gen_proto.py)")
            return 1
    print("generated code in sync")
    return 0


if __name__ == "__main__":
    sys.exit(main())
