"""The small part of systemd slicebox needs, and its pystemd implementation (system bus).

A systemd call is done when its job is done: :class:`PystemdSystemd` waits until the job has
left systemd's queue (bounded by a timeout), then checks the unit's state; a start that ends
``failed`` is retried once after ``ResetFailedUnit``, as containerd does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import ConfigDict

from slicebox.host import dbustypes as dbus
from slicebox.model.base import Model
from slicebox.model.errors import HostError
from slicebox.model.limits import Property
from slicebox.model.paths import CGROUP_MOUNT

log = logging.getLogger(__name__)
R = TypeVar("R")

ACTIVE = frozenset({"active", "activating", "reloading"})
_UNIT_EXISTS = "org.freedesktop.systemd1.UnitExists"
_NO_PROCESS = "org.freedesktop.systemd1.NoSuchProcess"
SYSTEMD = b"org.freedesktop.systemd1"
MANAGER_PATH = b"/org/freedesktop/systemd1"
MANAGER_INTERFACE = b"org.freedesktop.systemd1.Manager"
UNIT_PATH = b"/org/freedesktop/systemd1/unit"
UNIT_INTERFACE = b"org.freedesktop.systemd1.Unit"
SLICE_INTERFACE = b"org.freedesktop.systemd1.Slice"
SERVICE_INTERFACE = b"org.freedesktop.systemd1.Service"
TIMER_ACCURACY_USEC = 1_000_000  # systemd coalesces timers by a minute unless told otherwise


class UnitStatus(Model):
    model_config = ConfigDict(frozen=True)

    load_state: str  # loaded, not-found, stub...
    active_state: str  # active, inactive, failed...
    fragment_path: str = ""  # the unit file, when one is installed

    @property
    def installed(self) -> bool:
        return bool(self.fragment_path)

    @property
    def active(self) -> bool:
        return self.active_state in ACTIVE


class ServiceStatus(Model):
    """A transient service's run as systemd tells it: its state, main process and how it
    ended (``exited``: the main process is gone and ``code``/``status`` say how)."""

    model_config = ConfigDict(frozen=True)

    active_state: str
    sub_state: str
    result: str  # success, exit-code, signal, oom-kill, timeout, resources...
    main_pid: int
    exited: bool
    code: int  # ExecMainCode: CLD_EXITED (1), CLD_KILLED (2), CLD_DUMPED (3); 0 before exit
    status: int  # ExecMainStatus: the exit status, or the signal that ended it


class ListedUnit(Model):
    """One loaded unit as ``ListUnitsByPatterns`` lists it."""

    model_config = ConfigDict(frozen=True)

    name: str
    description: str
    active_state: str
    sub_state: str


class Systemd(Protocol):
    """Everything the slice manager asks of systemd. Each call returns once systemd is done."""

    def status(self, unit: str) -> UnitStatus: ...

    def invocation(self, unit: str) -> str:
        """The id of the unit's current activation while it is active (systemd's
        ``InvocationID``, in hex), "" while it is not: a unit stopped and started again, by
        anyone, has a new one."""

    def is_active(self, unit: str) -> bool:
        """Whether the unit is active (or activating, reloading) now. A unit systemd has not
        loaded is not, and asking does not load it: for units that are mostly gone when asked
        (a container's scope after its removal, a timer after its stop)."""

    def start_transient(self, unit: str, properties: Sequence[Property], description: str) -> None:
        """Start a new transient unit with ``properties``; a unit of that name that runs, has
        a file or drop-ins is refused with :class:`HostError` code ``unit_exists``."""

    def set_properties(self, unit: str, properties: Sequence[Property]) -> None:
        """Change a unit's properties now and until reboot (runtime drop-ins)."""

    def start(self, unit: str) -> None: ...

    def stop(self, unit: str) -> None:
        """Stop ``unit``; an unknown slice is fine (systemd makes slices on demand), any other
        unknown unit is :class:`HostError` code ``no_such_unit``."""

    def kill(self, unit: str, signal: int) -> None:
        """Send ``signal`` to every process of ``unit`` (``KillUnit``, whom ``all``); a unit
        systemd has not loaded, or one with no process left (a scope that stopped), is
        :class:`HostError` ``no_such_unit``."""

    def has_children(self, unit: str) -> bool:
        """Whether anything (a scope, a child slice) is running inside the unit."""

    def list_units(self, pattern: str, *, active_only: bool = False) -> list[str]:
        """Names of the loaded units matching a glob (only the active ones, if asked)."""

    def describe_units(self, pattern: str) -> dict[str, str]:
        """Each loaded unit matching a glob -> its Description, in the same one call as
        ``list_units`` (systemd lists both): how a deadline timer's lease is read back."""

    def start_timer(
        self,
        timer: str,
        at: datetime,
        argv: Sequence[str],
        description: str,
        bound_to: str | None = None,
    ) -> None:
        """Start a transient ``timer`` that runs ``argv`` (as a transient service of the same
        name) once at the wall-clock time ``at``, whether or not slicebox is still running.
        ``bound_to``: a unit (a container's scope) the timer lives no longer than: systemd
        stops the timer when that unit stops (``BindsTo=``); one that is not active now is
        refused with :class:`HostError` code ``no_such_unit``."""


class PystemdSystemd:
    """:class:`Systemd` over D-Bus with pystemd."""

    def __init__(
        self,
        timeout: float = 30.0,
        cgroup_root: Path = CGROUP_MOUNT,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._timeout = timeout
        self._cgroup_root = cgroup_root
        self._clock = clock
        self._sleep = sleep

    def status(self, unit: str) -> UnitStatus:
        return _call(
            unit,
            lambda: UnitStatus(
                load_state=_property(unit, UNIT_INTERFACE, b"LoadState"),
                active_state=_property(unit, UNIT_INTERFACE, b"ActiveState"),
                fragment_path=_property(unit, UNIT_INTERFACE, b"FragmentPath"),
            ),
        )

    def invocation(self, unit: str) -> str:
        def read() -> str:
            if _property(unit, UNIT_INTERFACE, b"ActiveState") not in ACTIVE:
                return ""  # one read, as a scope that has stopped (``wait_stopped``) answers
            path = _path(unit)
            value = _bus().get_property(SYSTEMD, path, UNIT_INTERFACE, b"InvocationID", b"ay")
            return bytes(value).hex()

        return _call(unit, read)

    def is_active(self, unit: str) -> bool:
        # A property read at a unit's path makes systemd load a unit it has not (a not-found
        # one, announced on the bus and collected again); GetUnit answers from what is loaded.
        from pystemd.dbusexc import DBusNoSuchUnitError

        def read() -> bool:
            try:
                path = _method(b"GetUnit", dbus.typed(b"s", unit.encode()))
            except DBusNoSuchUnitError:
                return False
            state = _bus().get_property(SYSTEMD, path, UNIT_INTERFACE, b"ActiveState", b"s")
            return bytes(state).decode() in ACTIVE

        return _call(unit, read)

    def start_transient(self, unit: str, properties: Sequence[Property], description: str) -> None:
        props: dict[bytes, Any] = dbus.named(properties)
        props[b"Description"] = description.encode()

        def args() -> list[Any]:
            return dbus.typed(b"ss", unit.encode(), b"fail") + dbus.array(props) + dbus.aux([])

        self._run_retrying(unit, b"StartTransientUnit", args)

    def set_properties(self, unit: str, properties: Sequence[Property]) -> None:
        _call(
            unit,
            lambda: _method(
                b"SetUnitProperties",
                dbus.typed(b"sb", unit.encode(), True) + dbus.array(dbus.named(properties)),
            ),
        )

    def start(self, unit: str) -> None:
        self._run_retrying(unit, b"StartUnit", lambda: dbus.typed(b"ss", unit.encode(), b"fail"))

    def stop(self, unit: str) -> None:
        self._run(unit, b"StopUnit", lambda: dbus.typed(b"ss", unit.encode(), b"fail"))
        if self.is_active(unit):  # a stopped transient unit is soon unloaded: not loaded again
            raise HostError(f"systemd did not stop {unit}; see `systemctl status {unit}`")

    def kill(self, unit: str, signal: int) -> None:
        try:
            _call(
                unit,
                lambda: _method(b"KillUnit", dbus.typed(b"ssi", unit.encode(), b"all", signal)),
            )
        except HostError as exc:
            if _NO_PROCESS not in exc.message:
                raise
            # Loaded still, but its last process is gone: as good as unloaded for a kill.
            raise HostError(f"nothing of {unit} runs: {exc.message}", code="no_such_unit") from exc

    def has_children(self, unit: str) -> bool:
        group = _call(unit, lambda: _property(unit, SLICE_INTERFACE, b"ControlGroup").lstrip("/"))
        directory = self._cgroup_root / group
        try:
            return any(entry.is_dir() for entry in directory.iterdir()) if group else False
        except FileNotFoundError:
            return False

    def list_units(self, pattern: str, *, active_only: bool = False) -> list[str]:
        units = _units(pattern, [b"active"] if active_only else [])
        return sorted(entry[0].decode() for entry in units)

    def describe_units(self, pattern: str) -> dict[str, str]:
        return {entry[0].decode(): entry[1].decode() for entry in _units(pattern, [])}

    def start_timer(
        self,
        timer: str,
        at: datetime,
        argv: Sequence[str],
        description: str,
        bound_to: str | None = None,
    ) -> None:
        service = timer.removesuffix(".timer") + ".service"
        calendar = at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC").encode()
        props: dict[bytes, Any] = {
            b"Description": description.encode(),
            b"TimersCalendar": [(b"OnCalendar", calendar)],
            b"AccuracyUSec": TIMER_ACCURACY_USEC,
            b"RemainAfterElapse": False,
        }
        if bound_to is not None:
            props[b"BindsTo"] = [bound_to.encode()]
            props[b"After"] = [bound_to.encode()]
        command = [(argv[0].encode(), [arg.encode() for arg in argv], False)]
        aux = {
            b"Description": description.encode(),
            b"ExecStart": command,
            b"CollectMode": b"inactive-or-failed",
        }
        dbus.known_signatures()
        # A ``bound_to`` unit that is not loaded: systemd answers NoSuchUnit ("Unit ... not
        # found"), which ``_call`` maps to ``no_such_unit``; the caller says what it means.
        self._run(
            timer,
            b"StartTransientUnit",
            lambda: (
                dbus.typed(b"ss", timer.encode(), b"fail")
                + dbus.array(props)
                + dbus.aux([(service.encode(), aux)])
            ),
        )
        if _state(timer) not in ACTIVE:
            raise HostError(f"systemd did not start {timer}; see `systemctl status {timer}`")

    def start_service(self, unit: str, properties: Mapping[str, Any], *, wait: bool) -> None:
        """Start a transient unit with ``properties`` typed by systemd's property table (file
        descriptors as ints, passed on to systemd); ``wait``: until its start job is done."""
        dbus.known_signatures()
        props = {name.encode(): value for name, value in properties.items()}

        def args() -> list[Any]:
            return dbus.typed(b"ss", unit.encode(), b"fail") + dbus.array(props) + dbus.aux([])

        if wait:
            self._run(unit, b"StartTransientUnit", args)
        else:
            _call(unit, lambda: _method(b"StartTransientUnit", args()))

    def service_status(self, unit: str) -> ServiceStatus | None:
        """The service's run; None when systemd has no such unit loaded (asking does not load
        it)."""
        from pystemd.dbusexc import DBusNoSuchUnitError

        def read() -> ServiceStatus | None:
            try:
                path = _method(b"GetUnit", dbus.typed(b"s", unit.encode()))
            except DBusNoSuchUnitError:
                return None
            bus = _bus()

            def get(interface: bytes, name: bytes, signature: bytes) -> Any:
                return bus.get_property(SYSTEMD, path, interface, name, signature)

            exit_at = get(SERVICE_INTERFACE, b"ExecMainExitTimestampMonotonic", b"t")
            return ServiceStatus(
                active_state=bytes(get(UNIT_INTERFACE, b"ActiveState", b"s")).decode(),
                sub_state=bytes(get(UNIT_INTERFACE, b"SubState", b"s")).decode(),
                result=bytes(get(SERVICE_INTERFACE, b"Result", b"s")).decode(),
                main_pid=int(get(SERVICE_INTERFACE, b"ExecMainPID", b"u")),
                exited=int(exit_at) > 0,
                code=int(get(SERVICE_INTERFACE, b"ExecMainCode", b"i")),
                status=int(get(SERVICE_INTERFACE, b"ExecMainStatus", b"i")),
            )

        return _call(unit, read)

    def listed(self, patterns: Sequence[str]) -> list[ListedUnit]:
        """Every loaded unit matching any of ``patterns``, in one call."""
        globs = [pattern.encode() for pattern in patterns]
        entries = _call(
            " ".join(patterns),
            lambda: _method(b"ListUnitsByPatterns", dbus.typed(b"asas", [], globs)),
        )
        return [
            ListedUnit(
                name=entry[0].decode(),
                description=entry[1].decode(),
                active_state=entry[3].decode(),
                sub_state=entry[4].decode(),
            )
            for entry in entries
        ]

    def reset_failed(self, unit: str) -> None:
        """Forget a failed unit (systemd keeps one until told); one that is not is fine."""
        from pystemd.dbusexc import DBusBaseError

        try:
            _method(b"ResetFailedUnit", dbus.typed(b"s", unit.encode()))
        except DBusBaseError:  # not loaded or not failed: nothing to forget
            return

    def _run_retrying(self, unit: str, method: bytes, args: Callable[[], list[Any]]) -> None:
        self._run(unit, method, args)
        if _state(unit) != "failed":
            return
        log.warning("%s failed to start; resetting it and retrying once", unit)
        _call(unit, lambda: _method(b"ResetFailedUnit", dbus.typed(b"s", unit.encode())))
        self._run(unit, method, args)
        if _state(unit) not in ACTIVE:
            raise HostError(f"systemd could not start {unit}; see `journalctl -u {unit}`")

    def _run(self, unit: str, method: bytes, args: Callable[[], list[Any]]) -> None:
        """Call ``method`` (one that queues a job) and wait for its job to finish."""
        job = _call(unit, lambda: _method(method, args()))
        self._wait_job(unit, job)

    def _wait_job(self, unit: str, job: bytes) -> None:
        deadline = self._clock() + self._timeout
        while any(entry[4] == job for entry in _call(unit, lambda: _method(b"ListJobs", []))):
            if self._clock() > deadline:
                raise HostError(f"systemd job for {unit} did not finish in {self._timeout}s")
            self._sleep(0.05)


def _units(pattern: str, states: list[bytes]) -> Any:
    """``ListUnitsByPatterns``: one entry (name, description, ...) per loaded unit."""
    return _call(
        pattern,
        lambda: _method(b"ListUnitsByPatterns", dbus.typed(b"asas", states, [pattern.encode()])),
    )


def _call(unit: str, call: Callable[[], R]) -> R:
    """``call``, with systemd's refusals mapped to codes callers can act on: a unit that is
    already there (``UnitExists``, which pystemd has no class for) and one that is not."""
    from pystemd.dbusexc import DBusBaseError, DBusNoSuchUnitError

    try:
        return call()
    except DBusNoSuchUnitError as exc:
        raise HostError(f"systemd has no unit {unit} loaded: {exc}", code="no_such_unit") from exc
    except DBusBaseError as exc:
        if _UNIT_EXISTS in str(exc):
            raise HostError(
                f"systemd says {unit} already exists; set its properties instead",
                code="unit_exists",
            ) from exc
        _drop_bus()  # the connection itself may be what failed: the next call opens a new one
        raise HostError(f"systemd refused an operation on {unit}: {exc}") from exc
    except Exception:
        _drop_bus()
        raise


# One system-bus connection per thread, opened on first use and kept: pystemd otherwise opens
# a connection for every property read and method call (a create cost a few dozen). A thread
# never shares its connection, so no call waits on another's reply.
_local = threading.local()


def _bus() -> Any:
    bus = getattr(_local, "bus", None)
    if bus is None:
        from pystemd.dbuslib import DBus

        bus = DBus()
        bus.open()
        _local.bus = bus
    return bus


def _drop_bus() -> None:
    bus = getattr(_local, "bus", None)
    _local.bus = None
    if bus is not None:
        try:
            bus.close()
        except Exception:  # already broken: nothing more to release
            log.debug("closing a failed system-bus connection failed", exc_info=True)


def _method(name: bytes, args: list[Any]) -> Any:
    """A call of systemd's manager on this thread's connection, ``args`` typed (``_typed``);
    the reply's body.

    The methods are called by name with their D-Bus signatures written here, not through
    pystemd's ``Manager`` object: that object first fetches and parses the manager's whole
    introspection XML, and keeps it, for each thread that ever called systemd (and Debian's
    pystemd, 0.13, fetched it again at every ``with``); see docs/benchmarks.md."""
    return _bus().call_method(SYSTEMD, MANAGER_PATH, MANAGER_INTERFACE, name, args).body


def _property(unit: str, interface: bytes, name: bytes) -> str:
    """A string property of a unit, read straight off the bus: a pystemd ``Unit`` object
    would first fetch and parse the unit's introspection XML, for every read."""
    value = _bus().get_property(SYSTEMD, _path(unit), interface, name, b"s")
    return bytes(value).decode()


def _state(unit: str) -> str:
    """The unit's ActiveState alone: one read where ``status`` makes three."""
    return _call(unit, lambda: _property(unit, UNIT_INTERFACE, b"ActiveState"))


def _path(unit: str) -> bytes:
    """The unit's object path: systemd loads the unit on demand when it is asked for one."""
    from pystemd.dbuslib import path_encode

    return bytes(path_encode(UNIT_PATH, unit.encode()))
