"""pystemd's and pyroute2's modules, imported without their packages' ``__init__``.

The agent uses a few modules of each: pystemd's D-Bus binding, its unit property table and its
journal call; pyroute2's ``IPRoute`` and ``setns``. Their packages' ``__init__`` import far more,
used or not: pystemd's its object layer and, through it, lxml (4 MiB of the agent's RSS in the
guest); pyroute2's every netlink family, IPDB, NDB and its CLI (14 MiB against 6 MiB for what
the agent reads). The agent's entry point registers each package as a bare namespace of its
submodules, the way the import system would have left it without an ``__init__``; importing
``pystemd.dbuslib`` or ``pyroute2.netns`` then loads that module and what it needs, nothing more.

Only the agent's own process does this (``sliceboxd``): a program that imports slicebox as a
library keeps the packages as their authors made them, and a package something already imported
is left as it is.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Sequence

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
