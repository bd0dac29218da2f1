"""Where things are on a host: one definition each, so no two modules can disagree."""

import os
from pathlib import Path, PurePosixPath

AGENT_SOCKET = "/run/slicebox/slicebox.sock"
# Where a client finds the agent when it is told (a nested sandbox's environment names its
# own socket there): the clients' and the CLI's default, else AGENT_SOCKET.
SOCKET_ENV = "SLICEBOX_SOCKET"


def agent_socket() -> str:
    """The agent's socket as this process's environment says (``SOCKET_ENV``)."""
    return os.environ.get(SOCKET_ENV) or AGENT_SOCKET


# A nested sandbox's socket lives in a directory of its own below this one (server.inner),
# the directory bound into that sandbox alone.
NESTED_ROOT = Path("/run/slicebox/nested")
CONFIG_PATH = Path("/etc/slicebox/config.toml")
# Docker's own default (docker-py and the CLI): /var/run is a link to /run on every systemd host.
DOCKER_SOCKET = "/var/run/docker.sock"
CGROUP_ROOT = PurePosixPath("/sys/fs/cgroup")
CGROUP_MOUNT = Path(CGROUP_ROOT)
