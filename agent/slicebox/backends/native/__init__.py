"""The native backend: a sandbox that systemd isolates on the host itself (``backend``)."""

from slicebox.backends.native.backend import NativeBackend, NativeSystemd
from slicebox.backends.native.envfiles import env_line
from slicebox.backends.native.names import (
    ANCHOR_PREFIX,
    EXEC_PREFIX,
    anchor_unit,
    glob_literal,
    is_native_exec,
    is_native_id,
    name_of,
    sandbox_slice,
)
from slicebox.backends.native.units import (
    MARK,
    WORKSPACE,
    describe,
    exit_code_of,
    hardening,
    labels_of,
    run_as_described,
    slice_properties,
)

__all__ = [
    "ANCHOR_PREFIX",
    "EXEC_PREFIX",
    "MARK",
    "WORKSPACE",
    "NativeBackend",
    "NativeSystemd",
    "anchor_unit",
    "describe",
    "env_line",
    "exit_code_of",
    "glob_literal",
    "hardening",
    "is_native_exec",
    "is_native_id",
    "labels_of",
    "name_of",
    "run_as_described",
    "sandbox_slice",
    "slice_properties",
]
