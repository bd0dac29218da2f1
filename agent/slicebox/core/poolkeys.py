"""A warm pool's key, and the ``[[pool]]`` table behind it: the settings that decide a container
once it runs (``model.pool.PoolKey``), read from an admitted request or a pool's table alike,
so equal keys mean equal containers; and the table a pool learned from demand would have."""

from slicebox.core.policy import Admitted, capability_name
from slicebox.model.config import PoolLearning
from slicebox.model.pool import PoolConfig, PoolKey
from slicebox.model.spec import Backend, SandboxSpec
from slicebox.model.wasm import digest


def key_of(admitted: Admitted) -> PoolKey | None:
    """The pool key of an admitted spec; None for one no pool may serve (it sets what a
    member cannot have been made with: a command, env, a workspace, credentials, mounts, a
    working directory). Requests and pools get theirs here alike."""
    spec = admitted.spec
    extras = (spec.command, spec.env, spec.workdir, spec.workspace, spec.credentials, spec.mounts)
    # An egress sandbox's address and rules are its own, made with it: no pool serves it.
    if any(extras) or not isinstance(spec.network, str):
        return None
    if spec.backend is Backend.WASM:
        return _wasm_key(admitted)
    if spec.backend is not Backend.DOCKER:
        return None
    return PoolKey(
        user=spec.user,
        project=spec.project,
        image=admitted.image,
        limits=admitted.limits,
        network=spec.network,
        run_as=spec.run_as or "",
        cap_add=tuple(sorted({capability_name(cap) for cap in spec.cap_add})),
        mounts=spec.mounts,
        reuse=spec.reuse,
    )


def _wasm_key(admitted: Admitted) -> PoolKey | None:
    """A wasm sandbox's key: its plugin is part of it (a member's worker is made for one), so
    only a plugin named by sha256 or uploaded (its digest known without reading a file) has
    one; no network but none (an allow-list is the plugin's own)."""
    spec = admitted.spec
    plugin = spec.wasm
    if plugin is None or plugin.path is not None or spec.network != "none":
        return None
    try:
        sha = plugin.sha256 or digest(plugin.module_bytes())
    except ValueError:
        return None  # the create says what is wrong with it
    return PoolKey(
        user=spec.user,
        project=spec.project,
        image="",
        limits=admitted.limits,
        network="none",
        run_as="",
        backend=Backend.WASM.value,
        plugin=sha,
    )


def spec_of(pool: PoolConfig) -> SandboxSpec:
    """A member's create request: the pool's settings, the rest the defaults."""
    fields = pool.model_dump(
        include={"user", "project", "image", "memory", "cpus", "pids", "network", "run_as", "reuse"}
    )
    if pool.backend is Backend.WASM:
        fields |= {"backend": "wasm", "wasm": {"sha256": pool.wasm_sha256}, "image": None}
    return SandboxSpec.model_validate(fields)


def learned_table(key: PoolKey, learning: PoolLearning) -> PoolConfig:
    """The ``[[pool]]`` table that would declare ``key``, as ``[pool_learning]`` sizes it."""
    return PoolConfig(
        user=key.user,
        project=key.project,
        size=learning.size,
        image=key.image,
        memory=key.limits.memory_bytes,
        cpus=key.limits.cpus,
        pids=key.limits.pids,
        network=key.network,
        run_as=key.run_as or None,
        idle_timeout_seconds=learning.window_seconds,
        backend=Backend(key.backend),
        wasm_sha256=key.plugin or None,
    )
