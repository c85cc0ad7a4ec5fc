"""Regenerate the committed Python code for every .proto under protos/ into client/pb/.

    python protos/generate.py [--out DIR]

protoc writes imports relative to the proto root (``from logitpool.v1 import ...``); they are
rewritten to ``client.pb.logitpool.v1`` so the generated modules import as part of the
``client`` package without sys.path tricks. The descriptors keep their proto-root names
(``logitpool/v1/logitpool.proto``), which is what gRPC reflection and the server expect.
Output is deterministic: tests/client/test_protos.py regenerates into a temp dir and compares.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
DEFAULT_OUT = REPO_ROOT / "client" / "pb"
PACKAGE_PREFIX = "client.pb"
GENERATED_SUFFIXES = (".py", ".pyi")


def proto_files(root: Path) -> list[str]:
    """Every .proto under root, as root-relative POSIX paths, sorted (stable output)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.proto"))


def _top_packages(files: list[str]) -> list[str]:
    return sorted({f.split("/", 1)[0] for f in files})


def fix_imports(source: str, top_packages: list[str]) -> str:
    """Rewrite ``from logitpool.v1 import x`` / ``import logitpool.v1.x`` to live under client.pb."""
    for top in top_packages:
        name = re.escape(top)
        source = re.sub(rf"^(\s*)from {name}(\.| import)", rf"\1from {PACKAGE_PREFIX}.{top}\2", source, flags=re.M)
        source = re.sub(rf"^(\s*)import {name}\.", rf"\1import {PACKAGE_PREFIX}.{top}.", source, flags=re.M)
        # The module name the message classes are registered under: pickle (Serve's gRPC proxy
        # pickles requests to hand them to a replica) imports it back, so it must be the real one.
        source = re.sub(
            rf"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')({name}\.)", rf"\1{PACKAGE_PREFIX}.\2", source
        )
    return source


def generate(out: Path) -> list[Path]:
    """Generate into ``out`` (replacing what a previous run wrote there); return the files written."""
    from grpc_tools import protoc  # dev dependency only; the client never imports it

    files = proto_files(PROTO_ROOT)
    if not files:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    well_known = str(resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *files,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        staged = Path(tmp)
        tops = _top_packages(files)
        for path in staged.rglob("*"):
            if path.suffix in GENERATED_SUFFIXES:
                path.write_text(fix_imports(path.read_text(), tops))
        # Every directory down to each generated module is a regular package.
        (staged / "__init__.py").touch()
        for path in list(staged.rglob("*")):
            if path.is_dir():
                (path / "__init__.py").touch()
        _replace_dir(staged, out)
    return sorted(p for p in out.rglob("*") if p.is_file())


def _replace_dir(src: Path, out: Path) -> None:
    """Swap ``out`` for ``src``, refusing to delete a folder holding anything but generated code."""
    if out.exists():
        foreign = [p for p in out.rglob("*") if p.is_file() and p.suffix not in (*GENERATED_SUFFIXES, ".pyc")]
        if foreign:
            raise SystemExit(f"refusing to replace {out}: it holds non-generated files {foreign[:3]}")
        shutil.rmtree(out)
    shutil.copytree(src, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output package dir (default: client/pb)")
    args = parser.parse_args(argv)
    for path in generate(args.out.resolve()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
