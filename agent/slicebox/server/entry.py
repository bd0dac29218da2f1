"""The program ``sliceboxd``: the agent's process is made lean (:mod:`slicebox.host.lean`)
before the daemon, its models and its libraries are imported, then :func:`daemon.main` runs.

Nothing else is imported here at module level: this module is what the console script and the
package's ``/usr/bin/sliceboxd`` import first.
"""

from __future__ import annotations

from slicebox.host.lean import lean_process


def main() -> int:
    lean_process()
    from slicebox.server import daemon

    return daemon.main()
