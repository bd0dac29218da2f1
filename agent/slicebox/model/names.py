"""Names are types: (user, project) <-> slice unit names <-> cgroup paths, pure and reversible.

systemd nests slices on dashes (``slicebox-a-b.slice`` lives in ``slicebox-a.slice``), so a dash
inside a user or project name is escaped as ``\\x2d``, exactly as ``systemd-escape`` does. Only
``[A-Za-z0-9._-]`` is accepted, starting with a letter, digit or underscore; everything else
(``..``, ``/``, empty, unicode, overlong) is refused with :class:`InvalidName` rather than
escaped, so a name always reads back the same on the host, in labels and in logs.
"""

import re
from pathlib import PurePosixPath

from pydantic import ConfigDict

from slicebox.model.base import Model
from slicebox.model.errors import InvalidName
from slicebox.model.paths import CGROUP_ROOT

PREFIX = "slicebox"
MANAGED_SLICE = f"{PREFIX}.slice"
MAX_NAME = 64
MAX_UNIT_NAME = 255  # systemd's UNIT_NAME_MAX
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_DASH = "\\x2d"


def check_name(kind: str, name: str) -> str:
    """Return ``name`` when it can map to a unit name, else raise :class:`InvalidName`."""
    if not name:
        raise InvalidName(f"the {kind} name is empty; give a name like 'alice' or 'my-project'")
    if len(name) > MAX_NAME:
        raise InvalidName(f"the {kind} name is longer than {MAX_NAME} characters; shorten it")
    if not _NAME.fullmatch(name):
        raise InvalidName(
            f"the {kind} name {name!r} is not allowed; use ASCII letters, digits, '.', '_' and "
            "'-', starting with a letter, digit or '_'"
        )
    return name


def escape(name: str) -> str:
    return name.replace("-", _DASH)


def unescape(part: str) -> str:
    return part.replace(_DASH, "-")


class SliceNames(Model):
    """The three slice unit names a sandbox of (user, project) lives under."""

    model_config = ConfigDict(frozen=True)

    managed: str
    user: str
    project: str

    def cgroups(self, root: PurePosixPath = CGROUP_ROOT) -> "SliceCgroups":
        managed = root / self.managed
        user = managed / self.user
        return SliceCgroups(managed=managed, user=user, project=user / self.project)


class SliceCgroups(Model):
    """The cgroup directories of the three slices (managed, user, project)."""

    model_config = ConfigDict(frozen=True)

    managed: PurePosixPath
    user: PurePosixPath
    project: PurePosixPath


def user_slice(user: str) -> str:
    return f"{PREFIX}-{escape(check_name('user', user))}.slice"


def project_slice(user: str, project: str) -> str:
    name = f"{PREFIX}-{escape(check_name('user', user))}-{escape(check_name('project', project))}"
    if len(name) + len(".slice") > MAX_UNIT_NAME:
        raise InvalidName("the user and project names are too long together; shorten them")
    return f"{name}.slice"


def slice_names(user: str, project: str) -> SliceNames:
    return SliceNames(
        managed=MANAGED_SLICE, user=user_slice(user), project=project_slice(user, project)
    )


def parse_slice(unit: str) -> tuple[str, str | None]:
    """Invert the mapping: a user or project slice name -> (user, project or None)."""
    if not unit.startswith(f"{PREFIX}-") or not unit.endswith(".slice"):
        raise InvalidName(f"{unit!r} is not a slicebox user or project slice")
    parts = unit[len(PREFIX) + 1 : -len(".slice")].split("-")
    if len(parts) > 2:
        raise InvalidName(f"{unit!r} nests deeper than a project slice")
    user = check_name("user", unescape(parts[0]))
    project = check_name("project", unescape(parts[1])) if len(parts) == 2 else None
    return user, project


# A container's scope as its engine's systemd cgroup manager names it: Docker's
# ``docker-<full id>.scope``, Podman's ``libpod-<full id>.scope`` (beside which Podman puts the
# container's monitor in ``libpod-conmon-<id>.scope``, not a sandbox). An agent talks to one
# engine: its start-up sets the prefix once, from what the engine says it is.
DOCKER_SCOPES = "docker"
PODMAN_SCOPES = "libpod"
PODMAN_MONITOR = "libpod-conmon-"
SCOPE_PREFIX_ENV = "SLICEBOX_SCOPE_PREFIX"  # how the expiry command, run by a timer, learns it
_scopes = {"prefix": DOCKER_SCOPES}


def use_scope_prefix(prefix: str) -> None:
    """Name containers' scopes ``<prefix>-<id>.scope`` from now on (the engine's way)."""
    if prefix not in (DOCKER_SCOPES, PODMAN_SCOPES):
        raise ValueError(f"unknown scope prefix {prefix!r}")
    _scopes["prefix"] = prefix


def scope_prefix() -> str:
    return _scopes["prefix"]


def scope_name(container_id: str) -> str:
    """The unit whose cgroup holds the sandbox: a container's scope, ``docker-<full id>.scope``
    under Docker; a native sandbox's backend id is its own slice unit already."""
    if container_id.endswith(".slice"):
        return container_id
    return f"{_scopes['prefix']}-{container_id}.scope"


def is_container_scope(unit: str) -> bool:
    """Whether ``unit`` (in a project slice) holds a sandbox: a container's own scope, not its
    monitor's, or a native sandbox's slice (the only slices a project slice holds)."""
    if unit.endswith(".slice"):
        return True
    return (
        unit.startswith(f"{_scopes['prefix']}-")
        and unit.endswith(".scope")
        and not unit.startswith(PODMAN_MONITOR)
    )


def scope_cgroup(
    user: str, project: str, container_id: str, root: PurePosixPath = CGROUP_ROOT
) -> PurePosixPath:
    return slice_names(user, project).cgroups(root).project / scope_name(container_id)
