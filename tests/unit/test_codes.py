"""The error-code registry is the truth: every code raised in the code base is listed in it
with the status it is answered with, every code listed is raised somewhere, and the table in
``docs/errors.md`` and the OpenAPI document are generated from it.

Codes are found in the source the way they are written: ``code="..."`` at a raise site, a
class's ``code = "..."`` when that class is raised without one, ``error_response(status,
"...")`` in the HTTP layer, and tables named ``*_CODE``/``*_CODES`` (a field's code).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from slicebox.model import errors
from slicebox.model.codes import BY_CODE, CODES, answered, markdown
from slicebox.server.openapi import document

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "agent" / "slicebox"
REGISTRY = PACKAGE / "model" / "codes.py"
CLASSES = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.SliceboxError)
}


def trees() -> Iterator[ast.AST]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != REGISTRY:
            yield ast.parse(path.read_text(), str(path))


def strings(node: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def code_values(expr: ast.expr) -> set[str]:
    """The literal codes an expression can give: ``"x"``, ``str(envelope.get("code", "x"))``."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return {expr.value}
    if isinstance(expr, ast.Call):
        args = expr.args[1:] if called(expr) == "get" else expr.args
        return set().union(*(code_values(arg) for arg in args))
    return set()


def called(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def raised_codes() -> dict[str, int | None]:
    """Every code raised in the package -> the HTTP status it is answered with, where known."""
    found: dict[str, int | None] = {}
    for tree in trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                found |= _from_call(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _is_code_table(node):
                found |= dict.fromkeys(_table_codes(node.value) - set(found), None)
    return found


def _from_call(call: ast.Call) -> dict[str, int | None]:
    cls = CLASSES.get(called(call))
    status = cls.http_status if cls else None
    explicit = [k.value for k in call.keywords if k.arg == "code"]
    if explicit:
        return dict.fromkeys(code_values(explicit[0]), status)
    if cls is not None:
        return {cls.code: status}
    if called(call) == "error_response":
        status_arg = call.args[0]
        known = status_arg.value if isinstance(status_arg, ast.Constant) else None
        return dict.fromkeys(code_values(call.args[1]), known if isinstance(known, int) else None)
    return {}


def _table_codes(value: ast.expr | None) -> set[str]:
    """A code constant, or the values (not the keys) of a table of codes."""
    if isinstance(value, ast.Dict):
        return set().union(*(strings(v) for v in value.values))
    return strings(value) if value is not None else set()


def _is_code_table(node: ast.Assign | ast.AnnAssign) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = [t.id for t in targets if isinstance(t, ast.Name)]
    return any(name.endswith(("_CODE", "_CODES")) for name in names)


def test_every_raised_code_is_registered_with_its_status() -> None:
    raised = raised_codes()
    missing = sorted(set(raised) - set(BY_CODE))
    assert not missing, f"raised but not in slicebox.model.codes: {missing}"
    answers = {c: s for c, s in raised.items() if s and BY_CODE[c].status is not None}
    wrong = {c: (s, BY_CODE[c].status) for c, s in answers.items() if s != BY_CODE[c].status}
    assert not wrong, f"answered with another status than registered: {wrong}"


def test_every_registered_code_is_raised() -> None:
    unused = sorted(set(BY_CODE) - set(raised_codes()))
    assert not unused, f"listed in slicebox.model.codes but never raised: {unused}"


def test_codes_are_unique_and_snake_case() -> None:
    assert len(BY_CODE) == len(CODES)
    assert all(code.replace("_", "").isalpha() and code.islower() for code in BY_CODE)


def test_the_table_in_docs_is_the_registry() -> None:
    assert (ROOT / "docs" / "errors.md").read_text() == markdown(), (
        "docs/errors.md is stale: run python3 -m slicebox.model.codes > docs/errors.md"
    )


def test_the_openapi_document_lists_every_answered_code() -> None:
    doc = document()
    assert list(doc["x-error-codes"]) == answered()
    assert doc["components"]["schemas"]["ErrorBody"]["properties"]["code"]["enum"] == answered()
    assert "agent_unreachable" not in answered()  # the client's own, never on the wire
