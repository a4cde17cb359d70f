"""Generate the Python stubs of proto/ into engine_contract/, or check they are current.

Run through `make proto` / `make proto-check`. grpcio-tools is pinned in the
`dev` extra, so the same .proto always gives byte-identical files.
"""

from __future__ import annotations

import argparse
import difflib
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto under proto/; return the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def committed_files() -> list[Path]:
    return sorted(
        p for p in (ROOT / "engine_contract").rglob("*") if p.name.endswith(GENERATED_SUFFIXES)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    check = parser.parse_args().check
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        fresh = {p.relative_to(out): p for p in generate(out)}
        current = {p.relative_to(ROOT): p for p in committed_files()}
        if check:
            stale = sorted(
                str(rel)
                for rel in fresh.keys() | current.keys()
                if rel not in fresh
                or rel not in current
                or not filecmp.cmp(fresh[rel], current[rel], shallow=False)
            )
            if stale:
                for rel in stale:
                    new = fresh[Path(rel)].read_text().splitlines() if Path(rel) in fresh else []
                    old = (
                        current[Path(rel)].read_text().splitlines() if Path(rel) in current else []
                    )
                    sys.stderr.writelines(
                        line + "\n" for line in difflib.unified_diff(old, new, rel, rel, n=1)
                    )
                print(
                    f"stale generated stubs: {', '.join(stale)}; run `make proto`", file=sys.stderr
                )
                return 1
            print(f"stubs current ({len(fresh)} files)")
            return 0
        for rel, path in current.items():
            if rel not in fresh:
                path.unlink()
        for rel, path in fresh.items():
            dest = ROOT / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not dest.exists() or not filecmp.cmp(path, dest, shallow=False):
                shutil.copyfile(path, dest)
                print(f"wrote {rel}")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
