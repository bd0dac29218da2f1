"""Fixtures shared by the real-host tests."""

from __future__ import annotations

from collections.abc import Iterator

import docker
import pytest


@pytest.fixture(scope="module")
def client() -> Iterator[docker.DockerClient]:
    """The guest's Docker engine, one connection per test module."""
    c = docker.from_env()
    yield c
    c.close()
