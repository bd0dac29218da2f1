"""How a reuse pool's member is made fit for its next request (``reuse: true``, opt-in).

Every process started since the member's acquire is killed in its scope cgroup (frozen while
it is enumerated, as an exec's timeout kill is: ``host.procs``), so nothing a run left
running reaches the next; its init and its ``sleep infinity`` are older and stay. Then the
places a non-root sandbox can write are emptied by an exec (``/workspace``, its tmpfs, and
``/tmp``, ``/var/tmp``, ``/dev/shm``), and whatever that exec started is killed too. The
member is healthy when that exec ran to exit code 0 and the container still runs. What a run
wrote elsewhere in the container's root filesystem stays: that is what ``reuse`` opts into
(``docs/pool.md``); without it every release destroys the member.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from slicebox.backends.base import SandboxBackend, SandboxState
from slicebox.core.blocking import from_thread
from slicebox.core.execution import ExecEngine
from slicebox.core.sandbox import Sandbox
from slicebox.host.procs import CgroupHost
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import ExecRequest

log = logging.getLogger(__name__)

SCRATCH = ("/workspace", "/tmp", "/var/tmp", "/dev/shm")
WIPE = ExecRequest(
    argv=(
        "sh",
        "-c",
        's=0; for d in "$@"; do [ ! -d "$d" ] || rm -rf "$d"/* "$d"/.[!.]* "$d"/..?* || s=1; '
        "done; exit $s",
        "wipe",
        *SCRATCH,
    ),
    cwd="/",
    timeout=30.0,
    output_cap=4096,
)


class MemberReset:
    """``core.pool.Reset`` on the real host."""

    def __init__(
        self,
        backend: SandboxBackend,
        engine: ExecEngine,
        host: CgroupHost,
        scope_of: Callable[[Sandbox], str],
    ) -> None:
        self._backend = backend
        self._engine = engine
        self._host = host
        self._scope_of = scope_of

    def mark(self) -> int:
        return self._host.process_clock()

    def reset(self, sandbox: Sandbox, since: int) -> bool:
        cgroup = self._host.cgroup_at(self._scope_of(sandbox))
        try:
            self._host.kill_since(cgroup, since)
            wiped = self._engine.run(sandbox.container_id, WIPE, self._scope_of(sandbox))
            self._host.kill_since(cgroup, since)
            info = from_thread(lambda _: self._backend.inspect(sandbox.container_id))
        except SliceboxError as exc:
            log.info("pool member %s could not be reset: %s", sandbox.id, exc.message)
            return False
        running = info is not None and info.state is SandboxState.RUNNING
        return running and wiped.exit_code == 0 and not wiped.timed_out
