"""Per-backend refusals: what a sandbox asks for that the backend chosen to run it cannot give,
refused before anything is made.

Docker gives every field of a spec; a native sandbox runs the host's own programs (a wasm
sandbox is one, its plugin in a worker), and a remote (daytona) one runs on the agent's Daytona
API. Each refusal is ``backend_unsupported``, naming the first field it cannot give.
"""

from __future__ import annotations

from slicebox.model.egress import NetworkSpec
from slicebox.model.errors import InvalidRequest
from slicebox.model.spec import Backend, SandboxSpec, WorkspaceKind
from slicebox.model.wasm import allowed_hosts

# The backends with no image on this host to look for: native and wasm run the host's own
# programs (a wasm sandbox's worker among them); a remote one's image is its service's to find.
NO_IMAGE = (Backend.NATIVE, Backend.WASM, Backend.DAYTONA)


def check_backend(spec: SandboxSpec, kind: Backend, *, pool_key: str = "") -> SandboxSpec:
    """The spec with ``kind``, the backend that runs it (the one it names, or native in
    Docker's place: ``SandboxBackend.resolve``); refused ``backend_unsupported`` when that
    backend cannot give what it asks."""
    if kind is Backend.NATIVE:
        check_native(spec, pool_key)
    if kind is Backend.WASM:  # a pool of wasm workers is one: their plugin is their key's
        check_native(spec, "", network=not isinstance(spec.network, NetworkSpec))
    if kind is Backend.DAYTONA:
        check_remote(spec, pool_key)
    return spec if kind is spec.backend else spec.model_copy(update={"backend": kind})


def check_native(spec: SandboxSpec, pool_key: str, *, network: bool = True) -> None:
    """Refuse, before anything is made, what a native sandbox cannot give (a wasm sandbox is
    one, whose plugin may reach the hosts of an egress allow-list: ``network`` False). A host
    workspace it gives: its units run as the caller, with it at /workspace."""
    _refuse(
        spec,
        _unsupported(spec, pool_key, network=network, host_workspace=True),
        "it runs the host's own programs with no network, no mount and no capability",
    )


def check_remote(spec: SandboxSpec, pool_key: str) -> None:
    """Refuse, before anything is made, what a remote (daytona) sandbox cannot give."""
    _refuse(
        spec,
        _unsupported(spec, pool_key, reuse=True),
        "it runs remotely, on the agent's Daytona API, with no network and nothing of this host's",
    )


def _unsupported(
    spec: SandboxSpec,
    pool_key: str,
    *,
    network: bool = True,
    host_workspace: bool = False,
    reuse: bool = False,
) -> list[str]:
    """The fields ``spec`` asks for that only a Docker sandbox gives."""
    workspace = spec.workspace
    asked = [
        ("network", network and spec.network != "none"),
        ("mounts", bool(spec.mounts)),
        (
            "workspace",
            workspace is not None and not (host_workspace and workspace.kind is WorkspaceKind.HOST),
        ),
        ("run_as", spec.run_as is not None),
        ("credentials", spec.credentials is not None),
        ("cap_add", bool(spec.cap_add)),
        ("privileged", spec.privileged),
        ("pid_mode", spec.pid_mode is not None),
        ("ipc_mode", spec.ipc_mode is not None),
        ("pool", bool(pool_key)),
        ("reuse", reuse and spec.reuse),
        ("from_snapshot", spec.from_snapshot is not None),  # a snapshot is an engine's image
    ]
    return [name for name, wanted in asked if wanted]


def _refuse(spec: SandboxSpec, refused: list[str], why: str) -> None:
    if refused:
        raise InvalidRequest(
            f"a {spec.backend.value} sandbox cannot give {', '.join(refused)}: {why}; leave "
            "these out or ask for backend docker",
            code="backend_unsupported",
            field=refused[0],
        )


def plugin_hosts(spec: SandboxSpec) -> tuple[str, ...]:
    """A wasm sandbox's egress allow-list as its plugin's allowed hosts."""
    if not isinstance(spec.network, NetworkSpec):
        return ()
    try:
        return allowed_hosts(spec.network.egress.entries())
    except ValueError as exc:
        raise InvalidRequest(str(exc), code="backend_unsupported", field="network") from exc
