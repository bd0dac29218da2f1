"""The service's files over a stand-in sandbox: the real scripts, run by the real sh and tar of
this machine below a directory (``tests.fakes.local_exec``), the rest of the world fakes."""

from __future__ import annotations

from pathlib import Path

from slicebox.core.execution import ExecEngine
from slicebox.core.files import Files
from slicebox.host.journal import Auditor
from slicebox.model.config import parse_config
from tests.fakes.local_exec import LocalExecs, LocalHost
from tests.unit.test_service import World


class FilesWorld(World):
    def __init__(self, tmp: Path, cap: int | None = None) -> None:
        super().__init__(tmp)
        self.root = tmp / "rootfs"
        (self.root / "workspace").mkdir(parents=True)
        self.execs, self.local = LocalExecs(self.root), LocalHost()
        engine = ExecEngine(self.execs, self.local)
        looked_up = self.service._looked_up
        self.service.files = Files(engine, Auditor(self.journal), self.sandboxes, looked_up)
        if cap is not None:
            self.sandboxes.reconfigure(parse_config(f"files_max_bytes = {cap}"))

    def transfers(self) -> list[dict[str, str]]:
        """The journal's file_transfer and refused records, as their fields."""
        kinds = ("file_transfer", "request_refused")
        return [dict(e) for e in self.journal.entries if e["SLICEBOX_EVENT"] in kinds]
