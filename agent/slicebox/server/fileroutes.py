"""The files routes: ``PUT``/``GET /v1/sandboxes/{id}/files`` and ``GET .../files/stat``.

The bodies are bytes, not JSON: a tar stream (``format=tar``, the default) or one file's
contents (``format=file``); the query string (``path``, ``format``) is parsed into
:class:`~slicebox.model.files.FilesQuery` at the edge. Nothing is read or written whole: an
upload's body is handed to the sandbox's tar chunk by chunk as Docker takes it (the request's
body is read from the socket only as the tar asks for it), and a download's chunks are written
as they come, the next read waiting until the caller's socket has taken the last (``await
response.write``). No thread is held while the bytes move: the look-up, the exec's create and
inspect and the audit record are short steps on the calls pool (see :mod:`slicebox.core.files`).

A download answers its head with the first bytes, so that a path that does not exist is an
error answer; an error after that (the cap reached, tar failing on a file it cannot read) cuts
the connection, and the caller sees a stream shorter than the chunked encoding promised, never
a tar that only looks complete. The head carries ``X-Slicebox-Files-Max-Bytes``, so a client
can say why.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator

from slicebox.model.errors import SliceboxError
from slicebox.model.files import FileFormat, FilesQuery, FileStat, Transferred
from slicebox.server.api import Route, identity_of, json_ok, parse_query
from slicebox.server.pools import pools_of
from slicebox.server.snapshotroutes import unpaused
from slicebox.server.state import service_of
from slicebox.web.message import ProtocolError
from slicebox.web.request import Content, Request
from slicebox.web.response import StreamResponse

log = logging.getLogger(__name__)

READ_SIZE = 64 * 1024
MAX_BYTES_HEADER = "X-Slicebox-Files-Max-Bytes"
MEDIA = {FileFormat.TAR: "application/x-tar", FileFormat.FILE: "application/octet-stream"}


class RequestBody:
    """An upload's body as the exec's stdin (a ``StdinSource``). A caller gone mid-body is a
    ``ConnectionResetError`` (audited ``abandoned``), and so is a body whose chunked framing
    breaks."""

    def __init__(self, content: Content) -> None:
        self._content = content

    async def read(self) -> bytes:
        try:
            return await self._content.read(READ_SIZE)
        except ProtocolError as exc:
            raise ConnectionResetError(f"the upload's body was cut off ({exc})") from exc


# The handlers, one a route; FILE_ROUTES below names each with its method, path and models.


async def upload(request: Request) -> StreamResponse:
    query, files = parse_query(request, FilesQuery), service_of(request).files
    done = await files.upload(
        identity_of(request),
        request.match_info["id"],
        query,
        body=RequestBody(request.content),
        blocking=pools_of(request).call,
        length=request.content_length,
    )
    return json_ok(done)


async def download(request: Request) -> StreamResponse:
    query, files = parse_query(request, FilesQuery), service_of(request).files
    chunks = files.download(
        identity_of(request), request.match_info["id"], query, pools_of(request).call
    )
    headers = {"Content-Type": MEDIA[query.format], MAX_BYTES_HEADER: str(files.cap())}
    return await _relay(request, chunks, StreamResponse(headers=headers))


async def stat(request: Request) -> StreamResponse:
    query, files = parse_query(request, FilesQuery), service_of(request).files
    found = await files.stat(
        identity_of(request), request.match_info["id"], query, pools_of(request).call
    )
    return json_ok(found)


# The files routes, in the order routes.ROUTES serves them.
FILE_ROUTES: list[Route] = [
    Route(
        "PUT",
        "/sandboxes/{id}/files",
        unpaused(upload),
        "Upload: a tar stream extracted into the directory `path` (made when missing), or "
        "with format=file one file's bytes written to `path`",
        None,
        Transferred,
        query=FilesQuery,
        raw_body=True,
    ),
    Route(
        "GET",
        "/sandboxes/{id}/files",
        unpaused(download),
        "Download: `path` as a tar stream, or with format=file one regular file's bytes",
        query=FilesQuery,
        raw_answer=True,
    ),
    Route(
        "GET",
        "/sandboxes/{id}/files/stat",
        unpaused(stat),
        "What is at `path`: a directory, a file, or something else",
        None,
        FileStat,
        query=FilesQuery,
    ),
]


async def _relay(
    request: Request, chunks: AsyncGenerator[bytes, None], response: StreamResponse
) -> StreamResponse:
    """Write ``chunks`` as they come; an error before the first is a plain error answer, one
    after it cuts the connection. Leaving early closes ``chunks``, which kills the exec."""
    async with contextlib.aclosing(chunks):
        chunk = await anext(chunks, None)
        try:
            await response.prepare(request)
            while chunk is not None:
                await response.write(chunk)
                chunk = await anext(chunks, None)
            await response.write_eof()
        except ConnectionError:
            pass  # the caller went away; the transfer is audited abandoned
        except Exception as exc:
            _cut_off(request, exc)
    return response


def _cut_off(request: Request, exc: Exception) -> None:
    """A download that failed after its head: the transfer's record says why; the caller gets
    a short stream, which its client reports as cut off."""
    if isinstance(exc, SliceboxError):
        log.info("download cut off: %s", exc)
    else:
        log.error("download failed after its head", exc_info=exc)
    if request.transport is not None:
        request.transport.close()
