"""The agent's process imports pystemd's and pyroute2's modules without their packages' init."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slicebox.host.lean import skip_package_inits

AGENT = Path(__file__).resolve().parents[2] / "agent"

# Every module of the two libraries the agent imports (host/systemd.py, journal.py, netstats.py).
USED = """
import sys
from slicebox.host.lean import skip_package_inits
print(skip_package_inits())
import slicebox.server.daemon, slicebox.client.aio
from pystemd.dbuslib import DBus, apply_signature, path_encode
from pystemd.dbusexc import DBusBaseError, DBusNoSuchUnitError
from pystemd.systemd1.unit_signatures import KNOWN_UNIT_SIGNATURES, signature_array
from pystemd import journal
from pyroute2.iproute.linux import IPRoute
from pyroute2.netns import setns
print(list(signature_array({b"MemoryMax": 1})))
print(sorted({"aiohttp", "docker", "requests", "urllib3", "lxml", "pystemd.base", "pyroute2.ndb"}
             & set(sys.modules)))
"""


def fresh_python(script: str) -> list[str]:
    """The lines ``script`` prints in a new interpreter that has only the agent on its path."""
    ran = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": str(AGENT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.splitlines()


def test_the_agent_loads_the_modules_it_uses_and_not_the_rest_of_their_packages() -> None:
    pytest.importorskip("pystemd.dbuslib")
    pytest.importorskip("pyroute2")
    registered, typed, loaded = fresh_python(USED)
    assert registered == "['pystemd', 'pystemd.systemd1', 'pyroute2']"
    assert "MemoryMax" in typed
    assert loaded == "[]"  # no HTTP framework or docker-py, no lxml, no pyroute2 databases


def test_a_package_already_imported_is_left_as_it_is() -> None:
    assert "pytest" in sys.modules
    assert skip_package_inits(["pytest", "no_such_package", "no_such_package.child"]) == []


# Every slicebox model, and whether importing the agent and the CLI built any of them.
MODELS = """
import pydantic
import slicebox.server.daemon, slicebox.cli.main
def models(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from models(sub)
ours = {m for m in models(pydantic.BaseModel) if m.__module__.startswith("slicebox.")}
ours = {m for m in ours if not m.__pydantic_generic_metadata__["origin"]}  # not Generic[X]
print(len(ours))
print(sorted(m.__qualname__ for m in ours if not m.model_config.get("defer_build")))
print(sorted(m.__qualname__ for m in ours if m.__pydantic_complete__))
"""


def test_importing_the_agent_or_the_cli_builds_only_the_models_it_instantiates() -> None:
    count, eager, built = fresh_python(MODELS)
    assert int(count) > 50
    assert eager == "[]", "every model derives from slicebox.model.base.Model"
    # Built at import: only those a module makes an instance of (the code table, an exec's
    # default); the config's tables are dicts its own validator reads (model.config._table).
    assert built == str(["ErrorCode", "ExecRequest"])


# What the agent's start does before its first answer: import the daemon, then build the app
# over every route. Neither may import what only some requests need, nor build a model the
# import did not (the OpenAPI document, every model's JSON schema, waits for its request).
START = """
import sys
from slicebox.host.lean import lean_process
lean_process()
import pydantic
import slicebox.server.daemon as daemon
from slicebox.host.identity import SystemUsers
def models(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from models(sub)
def built():
    return {m.__qualname__ for m in models(pydantic.BaseModel) if m.__pydantic_complete__}
before = built()
app = daemon.build_app(daemon.ROUTES, SystemUsers())
print(sorted(built() - before))
print(sorted(name for name in NOT_AT_START if name in sys.modules))
"""

# Modules the agent must not import at start (later issues keep this list green): optional
# backends' SDKs and workers, the CLI, the HTTP libraries the agent does without, the
# OpenAPI and configuration documents' generators.
NOT_AT_START = (
    "slicebox.cli",
    "slicebox.client",
    "slicebox.server.openapi",
    "slicebox.model.configdoc",
    "extism",
    "daytona",
    "daytona_sdk",
    "docker",
    "requests",
    "aiohttp",
    "urllib3",
    "pyroute2.ndb",
    "pystemd.base",
    "importlib.metadata",  # pydantic's plugin discovery (slicebox.host.lean), the version
)


def test_the_agents_start_imports_nothing_it_must_not_and_builds_no_further_model() -> None:
    pytest.importorskip("pystemd.dbuslib")
    pytest.importorskip("pyroute2")
    script = f"NOT_AT_START = {NOT_AT_START!r}\n" + START
    built, imported = fresh_python(script)
    assert built == "[]", "building the app built models (the OpenAPI document?)"
    assert imported == "[]"


PLUGINS = """
import sys
from slicebox.host.lean import without_pydantic_plugins
print(without_pydantic_plugins(), without_pydantic_plugins())
from pydantic.plugin._loader import get_plugins
from slicebox.model.api import CreateSandbox
CreateSandbox.model_validate({"project": "p"})
print(list(get_plugins()), "importlib.metadata" in sys.modules)
"""


def test_the_agents_process_runs_no_pydantic_plugin_and_never_looks_for_one() -> None:
    replaced, plugins = fresh_python(PLUGINS)
    assert replaced == "True False", "the loader is replaced once, before pydantic imports it"
    assert plugins == "[] False"


@pytest.mark.parametrize(
    ("entry", "program"),
    [
        ("slicebox.server.entry", "slicebox.server.daemon"),
        ("slicebox.cli.entry", "slicebox.cli.main"),
    ],
)
def test_each_program_is_made_lean_before_the_rest_is_imported(entry: str, program: str) -> None:
    """The console script's module imports nothing of its program until its main runs."""
    imported = fresh_python(
        f"import sys, {entry}\n"
        f"print(sorted(m for m in sys.modules if m.startswith(({program!r}, 'pydantic'))))"
    )
    assert imported == ["[]"]


LEAN_CLI = """
import sys
# A create's request is a model validated in this process; no agent answers at that socket.
sys.argv = ["slicebox", "--socket", "/nonexistent/sock", "create", "--project", "p"]
from slicebox.cli.entry import main
assert main() == 2, "refused: no agent at that socket"
print(sorted({"importlib.metadata", "pydantic.plugin._loader"} & set(sys.modules)))
loader = sys.modules["pydantic.plugin._loader"]
print(type(loader).__name__, loader.__doc__)
"""


def test_the_cli_runs_without_pydantic_plugins_too() -> None:
    modules, loader = fresh_python(LEAN_CLI)
    assert modules == "['pydantic.plugin._loader']", "the stub only: no metadata was read"
    assert loader == "module pydantic's plugin loader, finding none"


def test_the_model_layer_has_its_annotations_evaluated_once_not_compiled_by_pydantic() -> None:
    """See slicebox.model's docstring: no module of it postpones its annotations."""
    postponed = [
        path.name
        for path in sorted((AGENT / "slicebox" / "model").glob("*.py"))
        if "\nfrom __future__ import annotations\n" in path.read_text()
    ]
    assert postponed == []


FORWARD_REFS = """
import pkgutil, tomllib, typing  # tomllib's parser makes forward refs of its own
import pydantic
import slicebox.model

# pydantic's own first-use imports, and their forward refs (RootModel's ``root``, ...)
class Warm(pydantic.BaseModel):
    x: int | None = None

class WarmRoot(pydantic.RootModel[int]):
    pass

made = []
init = typing.ForwardRef.__init__
def counting(self, arg, *args, **kwargs):
    made.append(arg)
    init(self, arg, *args, **kwargs)
typing.ForwardRef.__init__ = counting
for module in pkgutil.iter_modules(slicebox.model.__path__):
    __import__(f"slicebox.model.{module.name}")
print(sorted(set(made)))
"""


def test_the_models_are_made_without_compiling_their_annotations() -> None:
    """Only the names written in quotes (a class not made yet) are forward references."""
    (made,) = fresh_python(FORWARD_REFS)
    assert made == "['LevelNode']"


COLLECTOR = """
import gc
from slicebox.host.lean import lean_process, started
lean_process()
print(gc.isenabled())
import slicebox.server.daemon
frozen_before = gc.get_freeze_count()
started()
print(gc.isenabled(), gc.get_freeze_count() > frozen_before + 10000)
started()
gc.disable()
lean_process()  # a collector turned off by someone else stays off
started()
print(gc.isenabled())
"""


def test_the_collector_waits_while_a_program_starts_then_leaves_its_start_frozen() -> None:
    paused, resumed, left_off = fresh_python(COLLECTOR)
    assert paused == "False"
    assert resumed == "True True", "the start's objects are out of the collector's reach"
    assert left_off == "False"


def test_each_program_resumes_collection_once_it_has_started() -> None:
    (enabled,) = fresh_python(
        "import gc, sys\n"
        "sys.argv = ['slicebox', '--socket', '/nonexistent/sock', 'ps']\n"
        "from slicebox.cli.entry import main\n"
        "assert main() == 2\n"
        "print(gc.isenabled())"
    )
    assert enabled == "True"


DATACLASSES = """
import dataclasses
made = []
process = dataclasses._process_class
def counting(cls, *args, **kwargs):
    made.append(f"{cls.__module__}.{cls.__qualname__}")
    return process(cls, *args, **kwargs)
dataclasses._process_class = counting
from slicebox.host.lean import lean_process
lean_process()
import slicebox.server.daemon, slicebox.cli.main
print(sorted(name for name in made if name.startswith("slicebox.")))
"""


def test_the_agent_and_the_cli_make_no_dataclass_as_they_start() -> None:
    """A dataclass compiles its methods' source as its class is made (about 5 ms each under
    emulation): what the agent and the CLI import at start uses NamedTuples and classes."""
    (made,) = fresh_python(DATACLASSES)
    assert made == "[]"
