"""Where things are on a host: one definition each, so no two modules can disagree."""

from pathlib import Path, PurePosixPath

AGENT_SOCKET = "/run/slicebox/slicebox.sock"
CONFIG_PATH = Path("/etc/slicebox/config.toml")
# Docker's own default (docker-py and the CLI): /var/run is a link to /run on every systemd host.
DOCKER_SOCKET = "/var/run/docker.sock"
CGROUP_ROOT = PurePosixPath("/sys/fs/cgroup")
CGROUP_MOUNT = Path(CGROUP_ROOT)
