"""Compile `protos/` into Python modules under `bitdelta/<service>/v1/`.

The generated modules are build outputs (git-ignored, never edited): the set-up
step runs `python -m bitdelta.protos_build`, and it is a no-op when nothing
changed. Code imports them as, e.g.,
`from bitdelta.delta_store.v1 import delta_store_pb2, delta_store_pb2_grpc`.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos"
STAMP = ROOT / "bitdelta" / ".protos-stamp"


def _proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def _digest(files: list[Path]) -> str:
    import grpc_tools

    h = hashlib.sha256(getattr(grpc_tools, "__version__", "").encode())
    for f in files:
        h.update(str(f.relative_to(PROTO_DIR)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def build(force: bool = False) -> bool:
    """Generate the modules if the protos changed; returns True if it ran protoc."""
    from importlib.resources import files as resource_files

    from grpc_tools import protoc

    protos = _proto_files()
    digest = _digest(protos)
    if not force and STAMP.exists() and STAMP.read_text() == digest:
        return False
    include = str(resource_files("grpc_tools") / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    # Make every generated directory a regular package.
    for p in protos:
        d = ROOT / p.relative_to(PROTO_DIR).parent
        while d != ROOT / "bitdelta":
            (d / "__init__.py").touch()
            d = d.parent
    STAMP.write_text(digest)
    return True


if __name__ == "__main__":
    ran = build(force="--force" in sys.argv)
    print("[protos] generated" if ran else "[protos] up to date")
