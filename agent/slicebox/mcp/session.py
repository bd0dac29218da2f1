"""What one MCP session holds: its client of the agent, its defaults, and the sandboxes it made.

A sandbox made here always has a deadline (the session's TTL unless the create gave one), so a
server killed with SIGKILL leaves nothing past it; one the create did not ask to ``keep`` is
destroyed when the session ends (stdin closed, SIGTERM, SIGINT), newest first, as
``AsyncClient``'s own context manager does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from slicebox.client.aio import AsyncClient
from slicebox.mcp.options import DEFAULT_MAX_TRANSFER, DEFAULT_PROJECT, DEFAULT_TTL
from slicebox.model.errors import InvalidRequest, SliceboxError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    socket: str
    project: str = DEFAULT_PROJECT
    ttl: int = DEFAULT_TTL
    max_transfer: int = DEFAULT_MAX_TRANSFER

    def __post_init__(self) -> None:
        if self.ttl <= 0:
            raise InvalidRequest("the MCP sandboxes' TTL is a positive number of seconds")
        if self.max_transfer <= 0:
            raise InvalidRequest("--max-transfer is a positive number of bytes")


@dataclass
class Session:
    settings: Settings
    client: AsyncClient
    made: dict[str, bool] = field(default_factory=dict)  # id -> keep, in creation order

    @classmethod
    def open(cls, settings: Settings) -> Session:
        return cls(settings, AsyncClient(settings.socket))

    def add(self, sandbox_id: str, keep: bool) -> None:
        self.made[sandbox_id] = keep

    def forget(self, sandbox_id: str) -> None:
        self.made.pop(sandbox_id, None)

    def doomed(self) -> list[str]:
        """The sandboxes the session's end destroys: not kept, newest first."""
        return [sandbox_id for sandbox_id, keep in reversed(self.made.items()) if not keep]

    async def close(self) -> None:
        """Destroy what the session made and did not keep, then close the connections."""
        try:
            for sandbox_id in self.doomed():
                try:
                    await self.client.destroy(sandbox_id)
                except SliceboxError as exc:
                    log.warning("could not destroy %s at the session's end: %s", sandbox_id, exc)
                self.forget(sandbox_id)
        finally:
            await self.client.aclose()
