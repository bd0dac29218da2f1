"""The lines a streamed create adds to the NDJSON streams: ``{"progress": …}`` as the create's
long steps go (``core.progress``), and a streamed create's ``{"created": <SandboxView>}`` last."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable

from slicebox.model.api import SandboxView
from slicebox.model.progress import ProgressEvent


async def created(made: Awaitable[SandboxView]) -> AsyncGenerator[SandboxView, None]:
    """The one event of a streamed create: its sandbox (its progress comes around it)."""
    yield await made


def progress_line(event: ProgressEvent | SandboxView) -> bytes:
    key = b"progress" if isinstance(event, ProgressEvent) else b"created"
    return b'{"' + key + b'": ' + event.model_dump_json().encode() + b"}\n"
