"""slicebox's own programs, imported lean: pystemd's and pyroute2's modules without their
packages' ``__init__``, pydantic without its plugins and without its 2.10 self-check of every
schema, and no garbage collection while they start.

The agent uses a few modules of each: pystemd's D-Bus binding, its unit property table and its
journal call; pyroute2's ``IPRoute`` and ``setns``. Their packages' ``__init__`` import far more,
used or not: pystemd's its object layer and, through it, lxml; pyroute2's every netlink
family, IPDB, NDB and its CLI, more than twice what the agent reads. All of it would stay in the
agent's resident memory for its life (docs/benchmarks.md). The agent's entry point registers
each package as a bare namespace of its submodules, the way the import system would have left it
without an ``__init__``; importing ``pystemd.dbuslib`` or ``pyroute2.netns`` then loads that
module and what it needs, nothing more.

pydantic calls its plugins (any installed distribution's entry point in the group ``pydantic``)
at every validation of every model: third-party code that would see each request the agent
validates, git tokens included, and whose discovery imports ``importlib.metadata`` and reads the
metadata of every installed distribution at the first model built, a cost every start pays for
plugins slicebox never uses. slicebox's programs run without them.

Python's cyclic garbage collector is paused while the program starts: imports and the models
they build make some hundred thousand objects that live as long as the process, and every
collection meanwhile walks them again, for nothing to collect. Once started, they are moved out
of the collector's way (``gc.freeze``) and collection resumes for what the program makes from
then on. What each of these costs a start is in docs/benchmarks.md.

Only slicebox's own programs do this, first thing (``sliceboxd``, :mod:`slicebox.server.entry`;
``slicebox``, :mod:`slicebox.cli.entry`): a program that imports slicebox as a library keeps the
packages as their authors made them, and a package something already imported is left as it is.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Iterable, Sequence

log = logging.getLogger(__name__)

# Parents first: a subpackage's spec is found through its parent's path.
LEAN_PACKAGES = ("pystemd", "pystemd.systemd1", "pyroute2")


def skip_package_inits(packages: Sequence[str] = LEAN_PACKAGES) -> list[str]:
    """Register each of ``packages`` without running its ``__init__``; the ones registered."""
    registered = []
    for name in packages:
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:  # a parent missing: the library is not installed
            continue
        if spec is None or spec.submodule_search_locations is None:
            continue
        sys.modules[name] = importlib.util.module_from_spec(spec)
        registered.append(name)
    log.debug("imported without their __init__: %s", registered)
    return registered


PYDANTIC_PLUGINS = "pydantic.plugin._loader"  # where pydantic finds its plugins (get_plugins)


def _no_plugins() -> Iterable[object]:
    return ()


def without_pydantic_plugins() -> bool:
    """pydantic without plugins in this process; False when its loader was already imported.

    pydantic's own switch (``PYDANTIC_DISABLE_PLUGINS``) turns them off; its loader module is
    also replaced by one that finds none, so ``importlib.metadata`` is not imported for it. A
    pydantic whose loader moved keeps the switch, which is all it documents."""
    os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"
    if PYDANTIC_PLUGINS in sys.modules:
        return False
    loader = types.ModuleType(PYDANTIC_PLUGINS, "pydantic's plugin loader, finding none")
    loader.get_plugins = _no_plugins  # type: ignore[attr-defined]
    sys.modules[PYDANTIC_PLUGINS] = loader
    return True


def without_schema_checks() -> None:
    """pydantic 2.10 (Debian trixie's) checks every core schema it generates against the schema
    of core schemas before it compiles it: a self-check of its own output, which pydantic 2.11
    dropped, paid for every model the process builds. Its switch turns it off in this process
    only; the guest tests' own processes, on the same pydantic, still build the models with the
    check."""
    os.environ["PYDANTIC_SKIP_VALIDATING_CORE_SCHEMAS"] = "1"


_paused: list[bool] = []  # set while this module paused the collector


def pause_collection() -> None:
    """No cyclic garbage collection until :func:`started`: the program's start is all objects
    that stay. A collector something else turned off is left off."""
    if gc.isenabled():
        gc.disable()
        _paused.append(True)


def started() -> None:
    """The program has started: what it made so far is frozen out of the collector's reach (it
    stays for the process's life) and collection resumes. Only where :func:`pause_collection`
    paused it; once."""
    if _paused:
        _paused.clear()
        gc.freeze()
        gc.enable()


def lean_process() -> None:
    """What ``sliceboxd`` and ``slicebox`` do first, before they import the rest of slicebox;
    each calls :func:`started` once it has."""
    pause_collection()
    skip_package_inits()
    without_pydantic_plugins()
    without_schema_checks()
