"""Fixtures shared by the real-host tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import docker
import pytest

from slicebox.backends.docker import DockerBackend
from slicebox.model.names import DOCKER_SCOPES, use_scope_prefix


@pytest.fixture(scope="module")
def client() -> Iterator[docker.DockerClient]:
    """The guest's Docker engine, one connection per test module."""
    c = docker.from_env()
    yield c
    c.close()


@pytest.fixture(scope="session", autouse=True)
def engine_scopes() -> Iterator[None]:
    """Name containers' scopes as the engine the tests talk to does (DOCKER_HOST may point at
    Podman's socket), as the agent's start-up does."""
    backend = DockerBackend.from_env()
    try:
        if backend.availability().available:
            use_scope_prefix(backend.scope_prefix)
    finally:
        asyncio.run(backend.aclose())  # its connection, or a later test reports it unclosed
    yield
    use_scope_prefix(DOCKER_SCOPES)
