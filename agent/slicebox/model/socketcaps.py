"""The ``[socket]`` table of the config: the agent's socket's caps per uid and in all
(:mod:`slicebox.web.limits`), read at start.

    [socket]
    connections_per_uid = 64      # connections one uid holds open (root: the totals only)
    connections = 1024            # all uids together, below the unit's LimitNOFILE (16384)
    in_flight_per_uid = 32        # requests one uid has in flight
    in_flight = 512
    body_bytes_per_uid = "32MB"   # request bodies read whole (JSON), held at once
    body_bytes = "128MB"
"""

from typing import Self

from pydantic import ConfigDict, Field, field_validator, model_validator

from slicebox.model.base import Model
from slicebox.model.limits import RawSize, parse_size

MAX_CONNECTIONS = 8192  # half the unit's LimitNOFILE: room for the engine's, D-Bus', files


class SocketConfig(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    connections_per_uid: int = Field(
        default=64, ge=1, description="connections one uid holds open at once (root: no cap)"
    )
    connections: int = Field(
        default=1024,
        ge=1,
        le=MAX_CONNECTIONS,
        description=f"connections of all uids at once (at most {MAX_CONNECTIONS}, half the "
        "unit's LimitNOFILE)",
    )
    in_flight_per_uid: int = Field(
        default=32, ge=1, description="requests one uid has in flight at once"
    )
    in_flight: int = Field(default=512, ge=1, description="requests in flight, all uids")
    body_bytes_per_uid: RawSize = Field(
        default="32MB", description="request bodies one uid has read whole and held at once"
    )
    body_bytes: RawSize = Field(default="128MB", description="the same, all uids")

    @field_validator("body_bytes_per_uid", "body_bytes")
    @classmethod
    def _size(cls, value: RawSize) -> RawSize:
        parse_size("socket body bytes", value)
        return value

    @model_validator(mode="after")
    def _per_uid_within_total(self) -> Self:
        pairs = (
            ("connections", self.connections_per_uid, self.connections),
            ("in_flight", self.in_flight_per_uid, self.in_flight),
            ("body_bytes", self.body_bytes_per_uid_bytes, self.body_bytes_bytes),
        )
        for name, per_uid, total in pairs:
            if per_uid > total:
                raise ValueError(f"{name}_per_uid is over {name}: give {name} at least as much")
        if self.body_bytes_per_uid_bytes < 2 * 1024 * 1024:
            raise ValueError("body_bytes_per_uid under 2MB refuses an honest create's body")
        return self

    @property
    def body_bytes_per_uid_bytes(self) -> int:
        return parse_size("socket.body_bytes_per_uid", self.body_bytes_per_uid)

    @property
    def body_bytes_bytes(self) -> int:
        return parse_size("socket.body_bytes", self.body_bytes)
