"""WebAssembly plugins: what a caller names (:class:`WasmSpec`) and how its sandbox runs them.

A ``wasm`` sandbox runs one Extism plugin. The caller gives it in one of three ways: a path to a
``.wasm`` file under its own bind roots (read by the agent beneath the root, as a bind source
is), the module's bytes uploaded with the request (base64), or the sha256 of one the agent
already holds. Every exec in the sandbox then calls one exported function of it: ``argv`` is
``[function]`` and the exec's stdin is the call's input.

The sandbox's own limits decide the plugin's: its memory limit gives ``max_pages`` (64 KiB
pages), each exec's timeout its ``timeout_ms``, and its network its ``allowed_hosts``
(``none``: no host; an egress allow-list: the names on it).
"""

import base64
import binascii
import hashlib
import re
from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from slicebox.model.base import Model
from slicebox.model.egress import AllowEntry, EntryKind

PAGE = 65536  # one WebAssembly page
MAX_PAGES = 65536  # 4 GiB: all a 32-bit module can address
MAX_PLUGIN_BYTES = 64 * 1024 * 1024
WORKER_RESERVE = 64 * 1024 * 1024  # of a sandbox's memory, left to the worker's own
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
FUNCTION = re.compile(r"[A-Za-z_][A-Za-z0-9_.$-]{0,127}")
# What the worker's exit status says of a call (backends.wasmrun): the plugin ran past its
# timeout, or asked for more memory than its max_pages.
EXIT_TIMEOUT = 124
EXIT_OOM = 137
EXIT_NO_FUNCTION = 127


class WasmSpec(Model):
    """The plugin of a ``wasm`` sandbox: exactly one of a path, an upload or a known sha256."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str | None = Field(default=None, min_length=1, max_length=4096)
    module: str | None = Field(default=None, min_length=1)  # base64 of the .wasm bytes
    sha256: Sha256 | None = None

    @model_validator(mode="after")
    def _one(self) -> "WasmSpec":
        given = [name for name in ("path", "module", "sha256") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(
                "give the plugin one way: path (a .wasm under your bind roots), module (its "
                "bytes, base64) or sha256 (one the agent holds)"
            )
        if self.module is not None and len(self.module) > MAX_PLUGIN_BYTES * 4 // 3 + 4:
            raise ValueError(f"the module is over {MAX_PLUGIN_BYTES // 2**20} MiB")
        if self.path is not None and not self.path.startswith("/"):
            raise ValueError("path is absolute: the .wasm file under one of your bind roots")
        return self

    def module_bytes(self) -> bytes:
        """The uploaded module's bytes (``module`` given)."""
        assert self.module is not None
        try:
            return base64.b64decode(self.module, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"module is not base64: {exc}") from exc


class WasmRun(Model):
    """How a wasm sandbox's execs run its plugin (kept with the sandbox, in its slice)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sha256: Sha256
    max_pages: int = Field(ge=1, le=MAX_PAGES)
    allowed_hosts: tuple[str, ...] = ()


def digest(module: bytes) -> str:
    return hashlib.sha256(module).hexdigest()


def max_pages_for(memory_bytes: int | None) -> int:
    """The plugin's page cap for a sandbox memory limit (None: unlimited -> 4 GiB). The worker
    itself (Python and Extism, a few tens of MiB) lives under the same limit: up to
    ``WORKER_RESERVE`` of it, at most half, is left to it, so a plugin meets Extism's ``oom``
    before the kernel's."""
    if not memory_bytes:
        return MAX_PAGES
    reserve = min(WORKER_RESERVE, memory_bytes // 2)
    return max(1, min(MAX_PAGES, (memory_bytes - reserve) // PAGE))


def is_wasm(module: bytes) -> bool:
    """A WebAssembly binary starts with ``\\0asm`` and version 1."""
    return module[:8] == b"\0asm\x01\0\0\0"


def allowed_hosts(entries: tuple[AllowEntry, ...]) -> tuple[str, ...]:
    """An egress allow-list as Extism's ``allowed_hosts`` (host globs, no port): names and
    ``*.domain`` wildcards as they are, a single address as itself; ValueError for what a
    plugin's runtime cannot filter (a port, a network wider than one address)."""
    hosts = []
    for entry in entries:
        if entry.port is not None:
            raise ValueError(
                f"{entry.text!r}: a wasm plugin's hosts take no port; leave ':{entry.port}' out"
            )
        if entry.kind is EntryKind.NETWORK:
            assert entry.network is not None
            if entry.network.prefixlen != 32:
                raise ValueError(
                    f"{entry.text!r}: a wasm plugin's hosts are names or single addresses, "
                    "not networks"
                )
            hosts.append(str(entry.network.network_address))
        else:
            hosts.append(entry.text)
    return tuple(hosts)
