"""The project's test plugins: WebAssembly text in this folder, compiled with wabt's
``wat2wasm`` (Debian's ``wabt``; tests/run-all installs it on the build machine, the guest
image carries it) into a directory of the caller's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLKIT = "toolkit"  # echo, count_vowels, spin, grow, http_get


def build(name: str, into: Path) -> Path:
    """``<name>.wat`` compiled to ``into/<name>.wasm``; a clear error without wat2wasm."""
    compiler = shutil.which("wat2wasm")
    if compiler is None:
        raise RuntimeError("wat2wasm is missing: apt-get install wabt (tests/run-all does)")
    out = into / f"{name}.wasm"
    subprocess.run([compiler, str(HERE / f"{name}.wat"), "-o", str(out)], check=True)
    return out
