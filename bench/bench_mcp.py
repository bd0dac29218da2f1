"""Bench: a tool call of ``slicebox mcp`` against the same request on the agent's socket.

    tests/guest/run /opt/slicebox-mcp/bin/python -m bench.bench_mcp [--rounds 200]

The SDK is in the MCP venv only (the guest's Debian python has none), hence its python. The
checkout's agent runs as the system service. One sandbox; both sides warm (a session
initialized, a connection kept) and taking turns each round, so a change in the guest's load
falls on both alike:

- MCP: ``sandbox_exec`` of ``echo hi`` through the SDK's own client session, over stdio to a
  ``python -m slicebox.mcp`` process (what an MCP client starts), which asks the agent;
- socket: ``AsyncClient.exec`` of the same request, in this process.

Printed: each side's median and the RATIO MCP / socket (target at most 1.2), and how many
answers were not exactly ``hi``. The sandbox is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from tests.host.agentunits import SOCKET, installed_agent

from slicebox.client import AsyncClient
from slicebox.model.api import CreateSandbox
from slicebox.model.exec import ExecRequest

ECHO = ExecRequest(argv=("echo", "hi"))
WARMUP = 5


async def timed(call: Callable[[], Awaitable[bool]], times: list[float]) -> bool:
    start = time.perf_counter()
    right = await call()
    times.append(time.perf_counter() - start)
    return right


async def bench(rounds: int, socket: str = str(SOCKET)) -> None:
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "slicebox.mcp", "--socket", socket],
        env={**os.environ},
    )
    async with AsyncClient(socket) as agent:  # removes the sandbox on exit
        box = await agent.create(CreateSandbox(project="mcpbench"))
        arguments = {"sandbox_id": box.id, "argv": ["echo", "hi"]}
        async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
            await session.initialize()

            async def over_mcp() -> bool:
                result = await session.call_tool("sandbox_exec", arguments)
                return (result.structuredContent or {}).get("stdout") == "hi\n"

            async def over_socket() -> bool:
                return (await agent.exec(box.id, ECHO)).stdout == b"hi\n"

            times: dict[str, list[float]] = {"mcp": [], "socket": []}
            wrong = 0
            for n in range(WARMUP + rounds):
                order = [("mcp", over_mcp), ("socket", over_socket)]
                for name, call in order if n % 2 else order[::-1]:
                    kept: list[float] = [] if n < WARMUP else times[name]
                    wrong += not await timed(call, kept)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"exec of echo, {rounds} rounds each, taking turns:")
    for name, median in medians.items():
        print(f"  {name:8} p50 {median * 1000:8.2f} ms")
    print(f"  RATIO mcp / socket {medians['mcp'] / medians['socket']:.2f} (target <= 1.2)")
    print(f"  answers that were not hi: {wrong}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    with installed_agent():
        subprocess.run(["systemctl", "start", "slicebox.socket"], check=True)
        asyncio.run(bench(args.rounds))


if __name__ == "__main__":
    main()
