"""The ``_async`` exec calls of a fake whose plain calls answer at once: the same answers,
awaited (a fake has nothing to wait for, so running them on the loop is what they would do)."""

from __future__ import annotations

from slicebox.model.exec import ExecRequest, ExecState


class ExecCallsOnLoop:
    def exec_create(
        self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        raise NotImplementedError

    def exec_inspect(self, exec_id: str) -> ExecState:
        raise NotImplementedError

    async def exec_create_async(
        self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        return self.exec_create(backend_id, request, streamed_stdin)

    async def exec_inspect_async(self, exec_id: str) -> ExecState:
        return self.exec_inspect(exec_id)

    def has_host(self, backend_id: str) -> bool:
        return True

    def exec_kill(self, exec_id: str) -> bool:
        return False  # as Docker: the engine kills the exec's processes through the host

    async def exec_kill_async(self, exec_id: str) -> bool:
        return self.exec_kill(exec_id)
