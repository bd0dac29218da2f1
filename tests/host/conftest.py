"""Fixtures shared by the real-host tests."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import docker
import pytest

from slicebox.backends.docker import DockerBackend
from slicebox.model.names import DOCKER_SCOPES, use_scope_prefix
from tests.host.pace import REFERENCE_SECONDS, pace


def pytest_report_header() -> str:
    """The host's pace, said where the run starts (pytest asks when started on tests/host)."""
    return (
        f"host pace {pace():.2f} (waiting limits scaled by it; 1.00 = a pure-Python workload "
        f"in {REFERENCE_SECONDS}s or less; tests/host/pace.py)"
    )


@pytest.fixture(scope="session", autouse=True)
def host_pace() -> float:
    """The pace, measured once and set in the environment of every process the tests start
    (a user's load client, a holder), so all of them wait alike."""
    os.environ["SLICEBOX_TEST_PACE"] = f"{pace():.3f}"
    return pace()


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
