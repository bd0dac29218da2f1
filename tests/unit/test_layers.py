"""The package's layers, read from its imports: the core is backend-neutral, and the agent
does not reach into the CLI or the clients.

Read from each module's own import statements (``ast``), lazy ones inside functions and those
under ``TYPE_CHECKING`` included: a layer that imports what it must not, however late, depends
on it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "agent" / "slicebox"


def imports(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


def test_the_core_imports_no_backend_but_the_interface() -> None:
    """Everything the core asks of a backend is on ``backends.base``'s protocols."""
    found = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in modules("core")
        for name in imports(path)
        if name.startswith("slicebox.backends")
        and not name.startswith("slicebox.backends.base")
        and name != "slicebox.backends"
    }
    assert not found


@pytest.mark.parametrize("layer", ["model", "host", "web", "backends", "core", "server"])
def test_the_agents_layers_import_neither_the_cli_nor_the_clients(layer: str) -> None:
    found = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in modules(layer)
        for name in imports(path)
        if name.startswith(("slicebox.cli", "slicebox.client"))
    }
    assert not found


def test_the_model_imports_nothing_of_the_rest() -> None:
    found = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in modules("model")
        for name in imports(path)
        if name.startswith("slicebox.") and not name.startswith("slicebox.model")
    }
    assert not found


BACKEND_MAKERS = (
    "Backends(",
    "DockerBackend(",
    "DockerBackend.from_env(",
    "NativeBackend(",
    "DaytonaBackend(",
)


def test_the_agents_backends_are_made_in_one_place() -> None:
    """One composition root: the daemon, the expiry command and doctor build their backends
    with ``slicebox.server.backends``; a backend's own modules (under ``backends/``) may make
    its like (a copy) or name it (a repr)."""
    makers = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "backends" not in path.relative_to(PACKAGE).parts[:-1]
        and any(maker in path.read_text() for maker in BACKEND_MAKERS)
    }
    assert makers == {"server/backends.py"}


# A room holds one concern: no module over 500 lines. The error-code registry is a data table.
MOST_LINES = 500
DATA_TABLES = {"model/codes.py"}


def test_no_module_grows_past_its_room() -> None:
    long = {}
    for path in PACKAGE.rglob("*.py"):
        name = str(path.relative_to(PACKAGE))
        lines = len(path.read_text().splitlines())
        if name not in DATA_TABLES and lines > MOST_LINES:
            long[name] = lines
    assert not long, f"split these (at most {MOST_LINES} lines a module): {long}"


# One way to do each thing: no method beside an async twin of itself (``aX``/``_aX``/``X_async``
# beside ``X``), in a class or a module. The public clients keep both, as users call both.
TWINS_ALLOWED = ("client/",)


def twins(tree: ast.Module) -> Iterator[str]:
    scopes: list[ast.Module | ast.ClassDef] = [tree]
    scopes += [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for scope in scopes:
        defined = {
            node.name: node
            for node in scope.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        for name in sorted(defined):
            if not _is_async(defined[name]):
                continue
            for plain in _plain_of(name):
                if plain in defined:
                    yield f"{getattr(scope, 'name', '<module>')}.{name} beside {plain}"


def _is_async(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """An async def, or a def that returns something awaited (an async generator)."""
    if isinstance(node, ast.AsyncFunctionDef):
        return True
    returns = ast.unparse(node.returns) if node.returns is not None else ""
    return any(word in returns for word in ("Async", "Awaitable", "Coroutine"))


def _plain_of(name: str) -> list[str]:
    """The names ``name`` would be the async twin of."""
    plain = []
    if name.endswith("_async"):
        plain.append(name.removesuffix("_async"))
    if name.startswith("_a") and len(name) > 2:
        plain.append("_" + name[2:])
    elif name.startswith("a") and len(name) > 1:
        plain.append(name[1:])
    return plain


def test_no_sync_and_async_twins() -> None:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = str(path.relative_to(PACKAGE))
        if name.startswith(TWINS_ALLOWED):
            continue
        pairs = list(twins(ast.parse(path.read_text())))
        if pairs:
            found[name] = pairs
    assert not found


def test_the_twin_finder_finds_each_kind() -> None:
    source = (
        "class A:\n    def get(self): ...\n    async def aget(self): ...\n"
        "    def _read(self): ...\n    async def _aread(self): ...\n"
        "def attach(): ...\nasync def attach_async(): ...\n"
        "def stream() -> It: ...\ndef astream() -> AsyncIterator[int]: ...\n"
        "def add(): ...\ndef dd(): ...\n"  # not twins: 'add' is no async 'dd'
    )
    assert sorted(twins(ast.parse(source))) == [
        "<module>.astream beside stream",
        "<module>.attach_async beside attach",
        "A._aread beside _read",
        "A.aget beside get",
    ]
