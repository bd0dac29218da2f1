"""What an exec or a run holds while it answers: its part of the output budget, the
caller's share first (core.budget), and for a streamed one a stream in flight
(core.shares). A refusal is audited where it is decided."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator

from slicebox.core.blocking import Blocking
from slicebox.core.budget import OutputBudget
from slicebox.core.execaudit import refused
from slicebox.core.instruments import Instruments
from slicebox.core.shares import Reservation, Slots, holder_of
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor
from slicebox.model.errors import SliceboxError


class Holdings:
    """The service's reservations (``core.service.Service`` is one)."""

    _budget: OutputBudget
    _auditor: Auditor
    streams: Slots
    instruments: Instruments

    def reserve(
        self, who: Identity, output_cap: int, action: str = "exec", sandbox_id: str = ""
    ) -> Reservation:
        """Take an exec's part of the output budget before it starts; over the caller's share
        (``output_share_full``) or the budget (``busy``) it is refused now and audited. The HTTP
        layer holds the reservation until the answer is sent: encoding the answer is when the
        output takes the most memory."""
        try:
            return self._budget.reserve(output_cap, holder_of(who))
        except SliceboxError as exc:
            self._auditor.record(refused(who, action, exc, sandbox_id, self.instruments))
            raise

    def reserve_stream(
        self, who: Identity, output_cap: int, action: str = "exec", sandbox_id: str = ""
    ) -> Reservation:
        """``reserve`` for a streamed exec or run, which also holds one of the streams in
        flight (``[shares] streams_in_flight``, the caller's share first) until it ends."""
        try:
            stream = self.streams.take(who)
        except SliceboxError as exc:
            self._auditor.record(refused(who, action, exc, sandbox_id, self.instruments))
            raise
        try:
            held = self.reserve(who, output_cap, action, sandbox_id)
        except BaseException:
            stream.release()
            raise
        return held.also(stream)

    @contextlib.asynccontextmanager
    async def _holding(
        self,
        who: Identity,
        output_cap: int,
        held: Reservation | None,
        *,
        blocking: Blocking,
        sandbox_id: str = "",
        action: str = "exec",
    ) -> AsyncIterator[Reservation]:
        """``held`` as it is (whoever took it releases it), or a reservation for the block,
        taken through ``blocking``: a refusal's record may block, so reserving does too."""
        if held is not None:
            yield held
            return
        reserve = functools.partial(self.reserve, who, output_cap, action, sandbox_id)
        with await blocking(reserve) as own:
            yield own
