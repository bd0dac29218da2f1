"""Admission as one pure pass: what a create request is decided to be, or its refusal, read
from the request, the backend that would run it, the configuration (its policy and ceilings)
and the caller's ids alone.

``decide`` asks nothing of the host and makes nothing: the backend's refusals
(core.refusals), policy and admission against the slice ceilings (core.policy), who the
sandbox runs as, and a wasm sandbox's allowed hosts from its egress allow-list. The create
(core.creation) then acts on the decided spec: it checks the volumes it names, pins its
binds, reserves its limits where ``[admission]`` counts what each level's sandboxes hold (the
one stateful part of admission, checked and counted at once: core.commitments, its arithmetic
in core.headroom, which the capacity answer shares), reads its wasm plugin and places it.
"""

from __future__ import annotations

from pydantic import ConfigDict

from slicebox.core.policy import (
    Admitted,
    admit,
    check_host_run_as,
    check_root,
    host_bound,
    workspace_mount,
)
from slicebox.core.refusals import check_backend, plugin_hosts
from slicebox.model.base import Model
from slicebox.model.config import Config
from slicebox.model.errors import PolicyViolation
from slicebox.model.spec import Backend, SandboxSpec


class Decided(Model):
    """A create request as admission decided it."""

    model_config = ConfigDict(frozen=True)

    # The spec with the backend that runs it, run_as and its host workspace's bind decided;
    # its image, limits and slices.
    admitted: Admitted
    # A wasm sandbox's plugin's allowed hosts (its egress allow-list); () for any other.
    plugin_hosts: tuple[str, ...] = ()


def decide(
    spec: SandboxSpec,
    kind: Backend,
    config: Config,
    host_memory: int,
    ids: tuple[int, int] | None,
    *,
    pool_key: str = "",
) -> Decided:
    """``spec`` as it will be made by the backend ``kind`` (``SandboxBackend.resolve``'s
    answer); raises the first refusal. ``ids``: the uid and primary gid of the user the
    sandbox is for (``caller_ids``), needed only with a host directory; ``pool_key``: a warm
    pool's member's."""
    spec = check_backend(spec, kind, pool_key=pool_key)
    decided = admitted(spec, config, host_memory, ids)
    wasm = kind is Backend.WASM and decided.spec.wasm is not None
    hosts = plugin_hosts(decided.spec) if wasm else ()
    return Decided(admitted=decided, plugin_hosts=hosts)


def admitted(
    spec: SandboxSpec, config: Config, host_memory: int, ids: tuple[int, int] | None
) -> Admitted:
    """The spec through policy and admission, with who it runs as decided."""
    return who_runs(admit(spec, config, host_memory), ids, config)


def who_runs(admitted: Admitted, ids: tuple[int, int] | None, config: Config) -> Admitted:
    """The spec with its host workspace as a bind at /workspace and ``run_as`` decided:
    with any host bind the owner's uid:gid and nothing else (what the sandbox writes there
    is theirs: policy.check_host_run_as); else as asked, or the configured non-root default."""
    spec = admitted.spec
    bind = workspace_mount(spec)
    run_as = spec.run_as
    if host_bound(spec):
        if ids is None:
            raise unknown_user(spec.user)
        uid, gid = ids
        run_as = check_host_run_as(spec, (uid, gid))
        if uid == 0:
            check_root(spec.user, spec, config)
    update = {
        "run_as": run_as or config.default_run_as,
        "mounts": (*spec.mounts, *([bind] if bind else [])),
    }
    return admitted.model_copy(update={"spec": spec.model_copy(update=update)})


def unknown_user(user: str) -> PolicyViolation:
    """A user the host does not know has no files a host directory could be given to."""
    return PolicyViolation(
        f"user {user!r} has no entry on this host, so a sandbox of theirs cannot run "
        "as them with a host directory; use a volume workspace",
        code="policy_run_as",
        field="workspace",
    )
