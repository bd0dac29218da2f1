"""The daytona backend: a sandbox that runs remotely, on a Daytona API, through its own SDK.

A daytona sandbox is a Daytona sandbox made from the request's image, with the request's
labels as its Daytona labels (plus ``slicebox.name``, the sandbox's name, which is how a look-up
by name finds it), its environment, cpus and memory rounded up to Daytona's whole CPUs and GiB,
and no network at all (``network_block_all``: the one network mode this backend gives). Its
backend id is ``daytona-`` then Daytona's id; an exec's id is ``daytona-exec-`` then a token
(:func:`is_daytona_id`, :func:`is_daytona_exec`), so a router tells them from the others by id.
There is no host pid, no waiter and no volume: those calls say ``backend_unsupported``.

**Execs** are Daytona's process execute, one HTTP call that answers with the exit code and the
command's output once it has ended, stdout and stderr combined as text (so it all arrives on
stdout, in one chunk, at the end; bytes that are not UTF-8 do not survive). The argv is run by a
small ``sh -c`` wrapper, started in ``/`` and quoted with :func:`shlex.join`, that

- takes its **stdin** from a file that the SDK's file API uploaded before (``/tmp/.slicebox-
  stdin-<token>``, streamed from a :class:`StdinSource` without holding it in memory), opened
  and unlinked before the command starts (deleted through the file API when the execute fails
  or is abandoned), or ``/dev/null`` when there is none;
- enters the request's **cwd** (``cd``, a path relative to ``/``), answering 126 with the
  shell's words when it is not there, as a native or Docker exec does;
- marks the command's environment with ``SLICEBOX_EXEC=<exec id>``, which its children
  inherit, so that a kill (another exec) finds and kills every process of the exec by it;
- ``exec``\\ s the argv with the request's env (Daytona's ``envs``).

Every path the wrapper names is relative to the ``/`` it starts in, so what it does depends
on Daytona's ``cwd`` alone (the local stand-in, ``tests.fakes.daytona``, maps that to a
directory of its own). ``/workspace``, the default cwd, is made at create by one such exec.

The SDK is imported when first needed: without it, :meth:`DaytonaBackend.availability` says
what to install and every other call is ``backend_unavailable``. The API key is a secret: it
is in no log line, message or repr of this package (what the SDK says is scrubbed of it).

Every call is written once, async, over the SDK's asyncio client: one per event loop, as its
HTTP session belongs to its loop. The awaited calls (inspect, the execs) use the running loop's;
the blocking ones of :class:`~slicebox.backends.base.SandboxBackend` (availability, create,
find, remove, usage), which worker threads call, await theirs through the
:class:`~slicebox.backends.base.Portal` the backend is given, on the agent's core loop, so
nothing waits on the agent's own loop.

Its rooms: :mod:`.terms` (ids, states, resources, what it refuses), :mod:`.scripts` (the shell
it runs), :mod:`.client` (the SDK, its clients and its errors), :mod:`.execs` (the exec table
and an exec's answer) and :mod:`.backend` (:class:`DaytonaBackend`).
"""

from slicebox.backends.daytona.backend import DaytonaBackend
from slicebox.backends.daytona.client import NO_SDK, ClientFactory, import_sdk
from slicebox.backends.daytona.scripts import exec_script, kill_script
from slicebox.backends.daytona.terms import (
    NAME_LABEL,
    daytona_id,
    is_daytona_exec,
    is_daytona_id,
    resources_of,
    state_of,
)

__all__ = [
    "NAME_LABEL",
    "NO_SDK",
    "ClientFactory",
    "DaytonaBackend",
    "daytona_id",
    "exec_script",
    "import_sdk",
    "is_daytona_exec",
    "is_daytona_id",
    "kill_script",
    "resources_of",
    "state_of",
]
