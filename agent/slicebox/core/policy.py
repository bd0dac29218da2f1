"""Create-time policy: what a sandbox may ask for, and admission against the slice ceilings.

Pure functions of (request, config, host memory) that raise before anything is created. What
the sandboxes already placed are provisioned is counted apart, where ``[admission]`` asks for it
(core.headroom, at the create's reservation in core.commitments). Each refusal has its own
stable code so a caller can tell them apart:

    policy_privileged, policy_host_namespace, policy_network, policy_capability, policy_mount,
    policy_root, policy_run_as, mount_escape (the kernel's checks of a bind source: host.beneath),
    ttl_too_long, invalid_limit, invalid_name, admission_refused
"""

from __future__ import annotations

import re
from ipaddress import IPv4Network
from pathlib import PurePosixPath

from pydantic import ConfigDict

from slicebox.backends.base import WORKSPACE, mounts_workspace
from slicebox.host.beneath import escape, outside_roots, root_for
from slicebox.model.base import Model
from slicebox.model.config import Config
from slicebox.model.egress import AllowEntry, EgressConfig, NetworkSpec
from slicebox.model.errors import AdmissionRefused, PolicyViolation
from slicebox.model.limits import (
    Ceiling,
    Limits,
    human_bytes,
    parse_cpus,
    parse_pids,
    parse_size,
    plain_number,
)
from slicebox.model.names import SliceNames, slice_names
from slicebox.model.spec import Mount, MountKind, SandboxSpec, WorkspaceKind

_VOLUME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class Placement(Model):
    """Where a sandbox goes and the ceilings of the three slices above it."""

    model_config = ConfigDict(frozen=True)

    names: SliceNames
    managed: Ceiling
    user: Ceiling
    project: Ceiling


class Admitted(Model):
    """A request that passed policy and admission, with everything resolved."""

    model_config = ConfigDict(frozen=True)

    spec: SandboxSpec
    image: str
    limits: Limits
    placement: Placement


def admit(spec: SandboxSpec, config: Config, host_memory: int) -> Admitted:
    """Check ``spec`` against the policy and the ceilings; raise on the first refusal."""
    check_security(spec, config)
    check_ttl(spec.ttl_seconds, config)
    limits, placement = sized(spec, config, host_memory)
    return Admitted(
        spec=spec, image=spec.image or config.default_image, limits=limits, placement=placement
    )


def sized(spec: SandboxSpec, config: Config, host_memory: int) -> tuple[Limits, Placement]:
    """The spec's limits (the defaults for those it leaves out) and its place in the slice
    tree, refused when no ceiling above could ever grant them: what a create's admission and
    the capacity answer's shape both go through, so a shape gets the codes a create would."""
    limits = resolve_limits(spec, config)
    placement = place(spec.user, spec.project, config, host_memory)
    check_admission(limits, placement)
    return limits, placement


def place(user: str, project: str, config: Config, host_memory: int) -> Placement:
    return Placement(
        names=slice_names(user, project),
        managed=config.managed_ceiling(host_memory),
        user=config.user_ceiling(user, host_memory),
        project=config.project_ceiling(user, project, host_memory),
    )


def resolve_limits(spec: SandboxSpec, config: Config) -> Limits:
    defaults = config.sandbox
    return Limits(
        memory_bytes=parse_size("memory", defaults.memory if spec.memory is None else spec.memory),
        cpus=parse_cpus("cpus", defaults.cpus if spec.cpus is None else spec.cpus),
        pids=parse_pids("pids", defaults.pids if spec.pids is None else spec.pids),
    )


def check_security(spec: SandboxSpec, config: Config) -> None:
    if spec.privileged:
        raise PolicyViolation(
            "privileged sandboxes are not allowed; drop 'privileged' and add only the "
            "capabilities you need",
            code="policy_privileged",
        )
    for field, mode in (("pid_mode", spec.pid_mode), ("ipc_mode", spec.ipc_mode)):
        if mode is not None:
            raise PolicyViolation(
                f"{field} {mode!r}: sandboxes cannot share host namespaces; leave {field} out",
                code="policy_host_namespace",
            )
    _check_network(spec, config)
    _check_capabilities(spec.cap_add, config)
    for mount in spec.mounts:
        check_mount(mount, config.bind_roots_for(spec.user))
    check_workspace(spec, config)
    check_run_as(spec, config)


def workspace_mount(spec: SandboxSpec) -> Mount | None:
    """A host workspace as the bind it is (its source still to be pinned by the kernel)."""
    workspace = spec.workspace
    if workspace is None or workspace.kind is not WorkspaceKind.HOST or workspace.path is None:
        return None
    return Mount(source=workspace.path, target=WORKSPACE, read_only=workspace.read_only)


def check_workspace(spec: SandboxSpec, config: Config) -> None:
    if spec.workspace is None:
        return
    if mounts_workspace(spec.mounts):
        raise PolicyViolation(
            f"both 'workspace' and a mount target {WORKSPACE}; give the one or the other",
            code="policy_mount",
        )
    bind = workspace_mount(spec)
    if bind is not None:
        check_mount(bind, config.bind_roots_for(spec.user))


def runs_as_root(run_as: str | None) -> bool:
    """Whether ``run_as`` names uid 0 in so many words (``0``, ``root``, ``0:0``...): a name
    that maps to 0 only in the image's passwd is found once the sandbox runs."""
    return run_as is not None and run_as.split(":", 1)[0].strip() in {"0", "root"}


def writable_host_mount(spec: SandboxSpec) -> bool:
    bind = workspace_mount(spec)
    binds = [*spec.mounts, *([bind] if bind else [])]
    return any(m.kind is MountKind.BIND and not m.read_only for m in binds)


def check_root(user: str, spec: SandboxSpec, config: Config) -> None:
    """Refuse uid 0 for ``user`` unless the config allows it, and with a writable host mount
    always: a root process with CAP_CHOWN/FSETID there plants setuid-root files on the host."""
    if user not in config.root_users:
        raise PolicyViolation(
            f"sandboxes of {user!r} may not run as uid 0; leave 'run_as' out (they run as a "
            "non-root uid) or name a non-root user, or ask an operator to add you to "
            "root_users",
            code="policy_root",
            field="run_as",
        )
    if writable_host_mount(spec):
        raise PolicyViolation(
            "a sandbox with a writable host mount may not run as uid 0; mount it read-only "
            "or run as a non-root user",
            code="policy_root",
            field="run_as",
        )


def check_run_as(spec: SandboxSpec, config: Config) -> None:
    if runs_as_root(spec.run_as):
        check_root(spec.user, spec, config)
    if _group_of(spec.run_as) in {"0", "root"} and spec.user not in config.root_users:
        raise PolicyViolation(
            f"sandboxes of {spec.user!r} may not run with gid 0 (group root); leave 'run_as' "
            "out or name a non-root uid:gid",
            code="policy_run_as",
            field="run_as",
        )


def _group_of(run_as: str | None) -> str | None:
    _, colon, gid = (run_as or "").partition(":")
    return gid.strip() if colon else None


def host_bound(spec: SandboxSpec) -> bool:
    """Whether the sandbox sees any host directory (a workspace or a mount, read-only too)."""
    bind = workspace_mount(spec)
    return any(m.kind is MountKind.BIND for m in (*spec.mounts, *([bind] if bind else [])))


def check_host_run_as(spec: SandboxSpec, owner: tuple[int, int]) -> str:
    """Who a sandbox with a host bind runs as: its owner's uid and primary gid, always. What it
    writes there (a set-id file among it) is theirs: a ``run_as`` naming another uid or group
    (docker's, root's, another user's) is refused before anything is made."""
    uid, gid = owner
    ids = f"{uid}:{gid}"
    if spec.run_as is not None and spec.run_as.replace(" ", "") != ids:
        raise PolicyViolation(
            f"a sandbox with a host directory runs as its owner, uid:gid {ids}; leave "
            f"'run_as' out (or give exactly {ids}), or use a volume workspace to choose the uid",
            code="policy_run_as",
            field="run_as",
        )
    return ids


def _check_network(spec: SandboxSpec, config: Config) -> None:
    network = spec.network
    if isinstance(network, NetworkSpec):
        _check_egress(spec.user, spec.project, network, config)
        return
    if network == "host":
        raise PolicyViolation(
            "network 'host' is not allowed; use 'none' (the default)", code="policy_host_namespace"
        )
    if network not in config.allowed_networks:
        allowed = ", ".join(sorted(config.allowed_networks))
        raise PolicyViolation(
            f"network {network!r} is not allowed; use one of: {allowed}", code="policy_network"
        )


def capability_name(cap: str) -> str:
    """A capability as the config and Docker name it: ``cap_net_raw`` is ``NET_RAW``."""
    return cap.upper().removeprefix("CAP_")


def _check_capabilities(cap_add: tuple[str, ...], config: Config) -> None:
    refused = sorted({capability_name(cap) for cap in cap_add} - config.allowed_capabilities)
    if refused:
        allowed = ", ".join(sorted(config.allowed_capabilities))
        raise PolicyViolation(
            f"capabilities {', '.join(refused)} are not allowed; choose from: {allowed}",
            code="policy_capability",
        )


def check_ttl(ttl_seconds: int | None, config: Config) -> None:
    """Refuse a deadline further off than the configured maximum, however large the number:
    it is compared as an int, before any date is computed from it."""
    most = config.max_ttl_seconds
    if ttl_seconds is not None and ttl_seconds > most:
        raise PolicyViolation(
            f"ttl_seconds is more than this agent's maximum of {_seconds(most)}; ask for at "
            "most that and extend the deadline before it passes, or ask an operator to raise "
            "max_ttl_seconds",
            code="ttl_too_long",
            field="ttl_seconds",
        )


def _seconds(count: int) -> str:
    return f"{count} seconds ({count / 3600:g} h)" if count >= 3600 else f"{count} seconds"


def check_mount(mount: Mount, roots: tuple[PurePosixPath, ...]) -> None:
    if mount.kind is MountKind.VOLUME:
        if not _VOLUME.fullmatch(mount.source):
            raise PolicyViolation(
                f"volume name {mount.source!r} is not valid; use letters, digits, '_.-'",
                code="policy_mount",
            )
        return
    source = PurePosixPath(mount.source)
    if source.is_absolute() and ".." in source.parts:
        raise escape(mount.source, "'..'")
    if not source.is_absolute() or root_for(source, roots) is None:
        raise outside_roots(mount.source, roots)


def check_admission(limits: Limits, placement: Placement) -> None:
    """Refuse limits that no ceiling above the sandbox could ever grant."""
    for level, ceiling in (("project", placement.project), ("user", placement.user)):
        for field, asked, cap in _pairs(limits, ceiling):
            if cap is not None and asked > cap:
                wanted, most = _amounts(field, asked, cap)
                raise AdmissionRefused(
                    f"{field} {wanted} exceeds the {level} ceiling of {most}; ask for at most "
                    f"{most} or raise the {level} ceiling in the config",
                    field=field,
                )


def _pairs(limits: Limits, ceiling: Ceiling) -> list[tuple[str, float, float | None]]:
    return [
        ("memory", limits.memory_bytes, ceiling.memory_bytes),
        ("cpus", limits.cpus, ceiling.cpus),
        ("pids", limits.pids, ceiling.pids),
    ]


def _amounts(field: str, asked: float, cap: float) -> tuple[str, str]:
    """Both values as people read them; exact bytes where rounding would make them look equal."""
    if field != "memory":
        return plain_number(asked), plain_number(cap)
    wanted, most = human_bytes(int(asked)), human_bytes(int(cap))
    if wanted.replace(".0 ", " ") == most.replace(".0 ", " "):  # "1.0 GiB" > "1 GiB" reads odd
        return f"{int(asked)} bytes", f"{int(cap)} bytes"
    return wanted, most


def _check_egress(user: str, project: str, network: NetworkSpec, config: Config) -> None:
    check_reachable(network.egress.entries(), config.egress)
    refused = config.egress.refused(user, project, network.egress.entries())
    if not refused:
        return
    if not any(rule.applies(user, project) for rule in config.egress.rule):
        raise PolicyViolation(
            f"network egress is not allowed for user {user!r} in project {project!r}; "
            "use network 'none', or ask the operator for an [[egress.rule]]",
            code="policy_egress",
        )
    raise PolicyViolation(
        f"egress to {', '.join(refused)} is not allowed for user {user!r} in project "
        f"{project!r}; leave these out, or ask the operator to allow them ([[egress.rule]])",
        code="policy_egress",
    )


def check_reachable(
    entries: tuple[AllowEntry, ...], egress: EgressConfig, *found: IPv4Network
) -> None:
    """Refuse entries that reach into the host, its bridges, loopback or link-local space
    (``found``: the host's own addresses and Docker's bridge subnets, known at run time)."""
    unreachable = egress.unreachable(entries, *found)
    if unreachable:
        raise PolicyViolation(
            f"egress to {', '.join(unreachable)} is never allowed: it reaches loopback, "
            "link-local (metadata) or all space, this host or its sandbox networks; name "
            "public hosts or networks, or ask the operator to list the network in "
            "[egress] internal_networks",
            code="policy_egress",
        )
