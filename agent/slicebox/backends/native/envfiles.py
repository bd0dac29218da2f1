"""A native sandbox's environment, kept off its units: a root-only file its anchor reads.

Unit properties are any local user's to read (``systemctl show``) and an environment may hold
secrets, so the sandbox's environment is not a property: it is a file in a directory for root
alone (``/run/slicebox/native-env``), ``<sandbox>.env``, that its anchor names in its
``EnvironmentFiles``; the init passes it on to every exec, whose own environment the agent
sends the init with the exec (``initwire``), never through systemd.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from slicebox.backends.native.names import EXEC_PREFIX

ENV_DIR = Path("/run/slicebox/native-env")


def env_line(key: str, value: str) -> str:
    """One ``EnvironmentFile`` line: the value double-quoted, its specials escaped."""
    quoted = re.sub(r'(["\\`$])', r"\\\1", value)
    return f'{key}="{quoted}"\n'


class EnvFiles:
    """The environment files of the native sandboxes, in one root-only directory."""

    def __init__(self, directory: Path = ENV_DIR) -> None:
        self.directory = directory

    def of_sandbox(self, name: str) -> Path:
        return self.directory / f"{name}.env"

    def write(self, path: Path, env: Mapping[str, str]) -> None:
        """``env`` as ``path``, for root alone: unit properties are anyone's to read."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.writelines(env_line(key, value) for key, value in env.items())

    def forget(self, name: str) -> None:
        """Remove the sandbox's file and those its execs left (an agent before the init's)."""
        self.of_sandbox(name).unlink(missing_ok=True)
        for path in self.directory.glob(f"{EXEC_PREFIX}{name}-*.env"):
            path.unlink(missing_ok=True)
