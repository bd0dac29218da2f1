"""The exec calls of a fake whose answers come at once: ``make_exec`` and ``exec_state`` answer,
and the awaited calls of :class:`~slicebox.backends.base.ExecApi` return those answers (a fake
has nothing to wait for, so answering on the loop is what it would do)."""

from __future__ import annotations

from slicebox.model.exec import ExecRequest, ExecState


class ExecCallsOnLoop:
    def make_exec(self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False) -> str:
        raise NotImplementedError

    def exec_state(self, exec_id: str) -> ExecState:
        raise NotImplementedError

    async def exec_create(
        self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        return self.make_exec(backend_id, request, streamed_stdin)

    async def exec_inspect(self, exec_id: str) -> ExecState:
        return self.exec_state(exec_id)

    def has_host(self, backend_id: str) -> bool:
        return True

    async def exec_kill(self, exec_id: str) -> bool:
        return False  # as Docker: the engine kills the exec's processes through the host
