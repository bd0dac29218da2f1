"""The native backend: a sandbox that systemd isolates on the host itself, no engine, no image.

A native sandbox is a slice of its own under its project slice, ``<project>-<id>.slice``
(``slicebox-alice-p-sbx\\x2d0a1b2c3d4e5f.slice``), carrying the sandbox's memory, cpu and pids
limits, so the kernel enforces them exactly as for a container's scope, and the level tree,
telemetry and the reaper read it the same way. In it:

- **its anchor**, ``slicebox-native-<id>.service``: the sandbox's main command (``sleep
  infinity`` unless the request names one), the holder of its dynamic user, its network and
  /tmp namespaces and its workspace while it runs;
- **one transient service per exec**, ``slicebox-exec-<id>-<n>.service``, that joins the
  anchor's namespaces (``JoinsNamespaceOf=``) and runs as the same dynamic user, its stdin,
  stdout and stderr pipes handed to systemd as file descriptors (what ``systemd-run --pipe``
  does), read on the agent's event loop with the Docker exec's caps, timeout and OOM verdict.

Every unit of a sandbox runs with ``DynamicUser=yes`` (a uid of its own, allocated while the
anchor runs), no capabilities, no new privileges, a private network with only AF_UNIX sockets,
``ProtectSystem=strict``, no /home, private /tmp and /dev, ``@system-service`` system calls,
and its workspace (``/run/slicebox/native/<id>``, a runtime directory the anchor's stop
removes) bound at ``/workspace`` as the only writable place besides /tmp.

**Where lineage and TTL live without a state file**: in systemd. The sandbox slice's
``Description`` is ``slicebox-native `` followed by its labels as JSON, the same labels a
container carries; a listing of units (one ``ListUnitsByPatterns``) gives every native sandbox
with its labels and, from its anchor, its state. The deadline timer is bound to the sandbox
slice as a container's is to its scope. The sandbox's environment, which may hold secrets, is
not a unit property (any local user can read those): it is a root-only file,
``/run/slicebox/native-env/<id>.env``, each exec's ``EnvironmentFile``.

Its rooms: ``names`` (the units' names, made and read back), ``units`` (pure tables of their
properties), ``envfiles`` (the root-only environment files), ``pipes`` (an exec's stdio on the
event loop) and ``backend`` (:class:`NativeBackend`: the lifecycle, execs as units, and the
dispatch of a wasm sandbox's execs to its worker).
"""

from slicebox.backends.native.backend import NativeBackend, NativeSystemd

__all__ = ["NativeBackend", "NativeSystemd"]
