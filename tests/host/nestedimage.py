"""The image nested sandboxes run in the guest tests (issue 44): busybox, the guest's own
Debian python3 with pydantic (its files as Debian installed them, compiled modules included),
and the checkout's ``slicebox`` package with a ``slicebox`` command, so the client and the CLI
run inside a sandbox as they do on a host. Made from the guest's files by ``docker import``
(the guest reaches no image registry), named by what went into it, and removed by its test."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import slicebox
from tests.host.helpers import sh

REPOSITORY = "slicebox-test/nested"
# The package as the tests import it: in the guest, the checkout's agent/ copied and compiled
# on the guest's disk (tests/guest/checkout-local), so the image has its compiled modules too.
CHECKOUT = Path(slicebox.__file__).resolve().parent
SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data"}
LAUNCHER = (
    b"#!/bin/sh\n"
    b'exec python3 -c "import sys; from slicebox.cli.entry import main; sys.exit(main())" "$@"\n'
)
# What the client and the CLI import from outside the standard library, found by importing it.
FIND_IMPORTS = (
    "import sys, slicebox.cli.main, slicebox.client;"
    "print('\\n'.join(sorted({m.__file__ for m in list(sys.modules.values())"
    " if getattr(m, '__file__', None) and 'dist-packages' in m.__file__})))"
)


def _dist_roots() -> list[Path]:
    """The top-level packages (or modules) under dist-packages that the CLI imports."""
    found = subprocess.run(
        [sys.executable, "-c", FIND_IMPORTS],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(CHECKOUT.parent)},
        cwd="/",
    ).stdout.split()
    roots = set()
    for name in found:
        path = Path(name)
        for parent in (path, *path.parents):
            if parent.parent.name == "dist-packages":
                roots.add(parent)
                break
    return sorted(roots)


def _libraries(programs: list[Path]) -> set[Path]:
    """Every shared library the programs load, the dynamic loader included."""
    found: set[Path] = set()
    for program in programs:
        out = sh("ldd", str(program), check=False).stdout
        for line in out.splitlines():
            words = line.split()
            if "=>" in words and len(words) > 2 and words[2].startswith("/"):
                found.add(Path(words[2]))
            elif words and words[0].startswith("/"):
                found.add(Path(words[0]))
    return found


def _files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if not any(part in SKIP for part in path.relative_to(root).parts):
            yield path


def tag() -> str:
    """The image's name: what goes into it (the checkout's package and the python) hashed."""
    digest = hashlib.sha256(sys.version.encode())
    for path in _files(CHECKOUT):
        if path.is_file() and path.suffix == ".py":
            digest.update(str(path.relative_to(CHECKOUT)).encode())
            digest.update(path.read_bytes())
    return f"{REPOSITORY}:{digest.hexdigest()[:12]}"


def build() -> str:
    """The image, made unless it is there; its name."""
    name = tag()
    if sh("docker", "image", "inspect", name, check=False).returncode == 0:
        return name
    stdlib = Path(f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}")
    python = Path(sys.executable).resolve()
    dynload = sorted((stdlib / "lib-dynload").glob("*.so"))
    roots = _dist_roots()
    compiled = [p for root in roots if root.is_dir() for p in root.rglob("*.so")]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        _busybox(tar)
        tar.add(python, arcname=f"usr/bin/{python.name}")
        _link(tar, "usr/bin/python3", python.name)
        for path in _files(stdlib):
            tar.add(path, arcname=str(path).lstrip("/"), recursive=False)
        for root in roots:
            tar.add(root, arcname=str(root).lstrip("/"))
        for library in _libraries([python, *dynload, *compiled]):
            tar.add(library.resolve(), arcname=str(library).lstrip("/"))
        tar.add(CHECKOUT, arcname="opt/slicebox/slicebox")
        _file(tar, "usr/local/bin/slicebox", LAUNCHER, 0o755)
    subprocess.run(
        [
            "docker",
            "import",
            "-c",
            "ENV PATH=/usr/local/bin:/usr/bin:/bin",
            "-c",
            "ENV PYTHONPATH=/opt/slicebox",
            "-c",
            'CMD ["/bin/sh"]',
            "-",
            name,
        ],
        input=buffer.getvalue(),
        capture_output=True,
        check=True,
    )
    return name


def remove() -> None:
    """Every image of this repository, this run's and any a killed run left."""
    listed = sh("docker", "image", "ls", "-q", REPOSITORY).stdout.split()
    if listed:
        sh("docker", "image", "rm", "-f", *sorted(set(listed)), check=False)


def _busybox(tar: tarfile.TarFile) -> None:
    tar.add("/bin/busybox", arcname="bin/busybox")
    applets = sh("/bin/busybox", "--list").stdout.split()
    for applet in applets:
        if applet != "busybox":
            _link(tar, f"bin/{applet}", "busybox")
    for directory, mode in (("tmp", 0o1777), ("workspace", 0o777), ("etc", 0o755)):
        info = tarfile.TarInfo(directory)
        info.type, info.mode = tarfile.DIRTYPE, mode
        tar.addfile(info)
    passwd = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
    _file(tar, "etc/passwd", passwd, 0o644)
    _file(tar, "etc/group", b"root:x:0:\nnogroup:x:65534:\n", 0o644)


def _link(tar: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    tar.addfile(info)


def _file(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))
