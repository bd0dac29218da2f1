"""``[metrics]``: what ``GET /metrics`` shows and where a scraper reaches it (docs/metrics.md).

The socket serves ``/metrics`` to every local caller (a non-admin sees their own user's
series). A scraper on the network side of the host reaches it on an optional TCP listener,
off unless ``listen`` is set; any local user can connect to a TCP port, so it answers only a
bearer token read from ``token_file`` (root's, mode 0600 or stricter) when the listener starts
and at every reload. Per-sandbox series are off unless the operator opts in, and capped.
"""

from ipaddress import ip_address
from pathlib import PurePosixPath

from pydantic import ConfigDict, Field, field_validator

from slicebox.model.base import Model

DEFAULT_TOKEN_FILE = PurePosixPath("/etc/slicebox/metrics.token")
PER_SANDBOX_MOST = 10_000  # however an operator sets the cap, a scrape stays bounded


class MetricsConfig(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    listen: str | None = Field(
        default=None,
        description='"address:port" of a TCP listener serving only GET /metrics to a '
        'scraper with the bearer token ("127.0.0.1:9464"; IPv6 as "[::1]:9464"); unset: none',
    )
    token_file: PurePosixPath = Field(
        default=DEFAULT_TOKEN_FILE,
        description="root's file (mode 0600) holding the listener's bearer token, read when the "
        "listener starts and at every reload; missing, empty or readable by others: no listener",
    )
    per_sandbox: bool = Field(
        default=False,
        description="series of each sandbox (its id a label value) besides the levels'",
    )
    per_sandbox_max: int = Field(
        default=200,
        ge=1,
        le=PER_SANDBOX_MOST,
        description="at most this many sandboxes get series of their own; the rest are only in "
        "their levels' (slicebox_metrics_sandboxes_dropped counts them)",
    )

    @field_validator("listen")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None:
            listen_address(value)
        return value

    def address(self) -> tuple[str, int] | None:
        """The listener's (host, port); None when there is none."""
        return None if self.listen is None else listen_address(self.listen)


def listen_address(text: str) -> tuple[str, int]:
    """``"127.0.0.1:9464"`` or ``"[::1]:9464"`` as (address, port): an IP literal, never a name
    (no resolver is asked at start), and a port 1-65535."""
    host, colon, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ip_address(host)
    except ValueError as exc:
        raise ValueError(
            f"{text!r}: give an IP address and a port, like 127.0.0.1:9464 or [::1]:9464"
        ) from exc
    if not colon or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
    return str(address), int(port)
