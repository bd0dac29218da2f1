"""The native backend: a sandbox that systemd isolates on the host itself, no engine, no image.

A native sandbox is a slice of its own under its project slice, ``<project>-<id>.slice``
(``slicebox-alice-p-sbx\\x2d0a1b2c3d4e5f.slice``), carrying the sandbox's memory, cpu and pids
limits, so the kernel enforces them exactly as for a container's scope, and the level tree,
telemetry and the reaper read it the same way. It is one machine, as a container is: every
process in it shares one process space, and what an exec leaves running lives on. In it:

- **its anchor**, ``slicebox-native-<id>.service``: the sandbox's init (``sandboxinit``, the
  host's python3), PID 1 of a PID namespace of its own (``PrivatePIDs=yes``), and the holder of
  its dynamic user, its user, mount, network, IPC and /tmp namespaces and its workspace while it
  runs. Every process of the sandbox is its fork, so each inherits all of its hardening; the
  sandbox's own command (``sleep infinity`` unless the request names one: the init's waiting
  does as well) is its child, and the sandbox ends with it;
- **one scope per exec**, ``slicebox-exec-<id>-<n>.scope``: the agent orders the exec on the
  init's socket (``/run/slicebox/init/<id>/init.sock``, root's and the sandbox user's alone),
  passing its argv, cwd, environment and stdio pipes; the init forks the exec's process, whose
  pid the kernel tells the agent, which moves it (by a pidfd, once it is checked to be the
  init's own new child: ``claims``) into the exec's scope before it runs the command. What it
  forks stays in that cgroup, which nothing of the sandbox can leave: a timeout or an abandoned
  stream stops the scope (SIGKILL to the whole cgroup, a fork bomb included) and nothing else,
  while a process left in the background keeps its scope alive, inside the sandbox's slice and
  ceilings, until it exits, a later exec kills it, or the sandbox goes. The output is read on
  the agent's event loop with the Docker exec's caps, timeout and OOM verdict, and ends with
  the command (``initexec``: not with a background process that holds the pipes).

Every process runs with ``DynamicUser=yes`` (a uid of its own, allocated while the anchor
runs), no capabilities, no new privileges, a private network whose one link is its own
loopback (IPv4 and IPv6 there, for a server one exec starts and the next one asks; every
other address denied), ``ProtectSystem=strict``, no /home, private /tmp and /dev,
``@system-service`` system calls, and its workspace (``/run/slicebox/native/<id>``, a runtime
directory the anchor's stop removes) bound at ``/workspace`` as the only writable place
besides /tmp.

**Where lineage and TTL live without a state file**: in systemd. The sandbox slice's
``Description`` is ``slicebox-native `` followed by its labels as JSON, the same labels a
container carries; a listing of units (one ``ListUnitsByPatterns``) gives every native sandbox
with its labels and, from its anchor, its state. The deadline timer is bound to the sandbox
slice as a container's is to its scope. The sandbox's environment, which may hold secrets, is
not a unit property (any local user can read those): it is a root-only file,
``/run/slicebox/native-env/<id>.env``, the anchor's ``EnvironmentFile``, which the init passes
on to every exec; an exec's own goes to the init with its order. A restarted agent finds each
init by its socket's path, so running sandboxes keep working; one made before the init (its
anchor a plain command) is still listed and destroyed, and its execs are refused.

Its rooms: ``names`` (the units' and cgroups' names, made and read back), ``units`` (pure
tables of their properties), ``envfiles`` (the root-only environment files), ``sandboxinit``
(the init, standard library only), ``initwire`` (the agent's side of its wire), ``claims``
(whether a pid the init names may be moved), ``pipes`` and ``initexec`` (an exec's stdio and
end on the event loop) and ``backend`` (:class:`NativeBackend`: the lifecycle, execs through
the init, and the dispatch of a wasm sandbox's execs to its worker).
"""

from slicebox.backends.native.backend import NativeBackend, NativeSystemd

__all__ = ["NativeBackend", "NativeSystemd"]
