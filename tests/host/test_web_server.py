"""The agent's HTTP server (``slicebox.web``) on the Python the package runs on: the guest's."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from slicebox.web.client import HttpClient
from slicebox.web.server import serve
from tests.unit.test_web_server import echo_app, run

pytestmark = [pytest.mark.host, pytest.mark.filterwarnings("error")]  # as the unit module


def test_a_passed_sockets_file_outlives_the_server(tmp_path: Path) -> None:
    """The socket systemd passes (slicebox.socket) stays for the next agent: from Python 3.13
    on, a server made by ``start_unix_server`` unlinks its socket's file at close, and after a
    restart (a package upgrade's) the agent listened on a file that was gone. Marked ``host``:
    it runs in the guest, on the Python the package runs on (the build machine's 3.11
    never unlinks)."""
    path = tmp_path / "passed.sock"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(path))
    listening.listen()

    async def twice() -> list[int]:
        statuses = []
        for _ in range(2):  # an agent, then the next one on the same socket
            serving = await serve(echo_app(), listening.dup())
            async with HttpClient.unix(str(path)) as http:
                answer = await http.request("GET", "/echo")
                await answer.read()
                statuses.append(answer.status)
            await serving.close(timeout=1)
            assert path.exists(), "closing the server removed the passed socket's file"
        return statuses

    try:
        assert run(twice) == [200, 200]
    finally:
        listening.close()
