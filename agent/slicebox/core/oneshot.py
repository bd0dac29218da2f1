"""One-shot runs (the seeds' ``execute(request, config)``): acquire a sandbox, exec, destroy.

The sandbox comes from a ``SandboxProvider``: anything that creates a running container from a
config and destroys it again. The real provider is the sandbox lifecycle (slice tree, labels,
warm pool); ``MinimalDockerProvider`` here is a small stand-in that starts a hardened container
directly, used by the guest tests and the bench until the lifecycle is wired in.

The sandbox is destroyed whatever happened, a timed-out run included: nothing a command left
running in it can outlive the run.
"""

from __future__ import annotations

import logging
from typing import Protocol, TypeVar

import docker
import docker.errors
from pydantic import BaseModel, ConfigDict, Field

from slicebox.core.execution import ExecEngine
from slicebox.model.errors import HostError, Unavailable
from slicebox.model.exec import ExecRequest, ExecResult

log = logging.getLogger(__name__)

ConfigT_contra = TypeVar("ConfigT_contra", contravariant=True)


class SandboxProvider(Protocol[ConfigT_contra]):
    def create(self, config: ConfigT_contra) -> str:
        """Start a sandbox container for ``config`` and return its id."""

    def destroy(self, container_id: str) -> None:
        """Remove the container and everything in it; idempotent."""


def execute(
    request: ExecRequest,
    config: ConfigT_contra,
    *,
    provider: SandboxProvider[ConfigT_contra],
    engine: ExecEngine,
) -> ExecResult:
    """Create a sandbox from ``config``, run ``request`` in it, destroy it, return the result."""
    container_id = provider.create(config)
    try:
        result = engine.run(container_id, request)
    finally:
        provider.destroy(container_id)
    log.info("one-shot run in %s exited %s", container_id, result.exit_code)
    return result


class MinimalSandboxConfig(BaseModel):
    """What ``MinimalDockerProvider`` needs; the lifecycle's own config replaces it later."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str
    cgroup_parent: str = Field(pattern=r"^[A-Za-z0-9_.\\-]+\.slice$")
    memory_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    cpus: float = Field(default=0.5, gt=0)
    pids: int = Field(default=100, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    workspace_tmpfs_bytes: int = Field(default=64 * 1024 * 1024, gt=0)


def hardened_run_options(config: MinimalSandboxConfig) -> dict[str, object]:
    """docker-py ``containers.run`` options of the security defaults (a pure mapping)."""
    return {
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "network_mode": "none",
        "pids_limit": config.pids,
        "mem_limit": config.memory_bytes,
        "memswap_limit": config.memory_bytes,
        "nano_cpus": int(config.cpus * 1e9),
        "init": True,
        "cgroup_parent": config.cgroup_parent,
        "environment": dict(config.env),
        "tmpfs": {"/workspace": f"size={config.workspace_tmpfs_bytes},mode=1777"},
    }


def hardened_cli_flags(config: MinimalSandboxConfig) -> list[str]:
    """The same options as ``docker run`` flags (the bench compares against them)."""
    flags = [
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        "--network=none",
        f"--pids-limit={config.pids}",
        f"--memory={config.memory_bytes}",
        f"--memory-swap={config.memory_bytes}",
        f"--cpus={config.cpus}",
        "--init",
        f"--cgroup-parent={config.cgroup_parent}",
        f"--tmpfs=/workspace:size={config.workspace_tmpfs_bytes},mode=1777",
    ]
    return flags + [f"--env={key}={value}" for key, value in config.env.items()]


class MinimalDockerProvider:
    """A hardened ``sleep infinity`` container per sandbox, removed with force on destroy."""

    def __init__(self, client: docker.DockerClient) -> None:
        self._client = client

    def create(self, config: MinimalSandboxConfig) -> str:
        try:
            container = self._client.containers.run(
                config.image, ["sleep", "infinity"], detach=True, **hardened_run_options(config)
            )
        except docker.errors.ImageNotFound as exc:
            raise HostError(f"image {config.image} is not on this host: pull it first") from exc
        except docker.errors.DockerException as exc:
            raise Unavailable(f"Docker could not start a sandbox: {exc}") from exc
        return str(container.id)

    def destroy(self, container_id: str) -> None:
        try:
            self._client.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            return
        except docker.errors.DockerException as exc:
            raise Unavailable(f"Docker could not remove sandbox {container_id}: {exc}") from exc
