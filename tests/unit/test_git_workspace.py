"""Git workspaces and their credentials: the askpass helper run by a real ``sh``, the clone's
arguments, and a create that delivers the token to its own directory only (never argv, labels
or the environment), clones in the sandbox, and leaves nothing when the clone fails."""

from __future__ import annotations

import itertools
import json
import stat
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

from slicebox.backends.base import SandboxRequest, StdinSource
from slicebox.cli import main as cli
from slicebox.client import wire
from slicebox.core.credentials import ASKPASS, ASKPASS_SCRIPT, MOUNTED_AT, CredentialStore
from slicebox.core.gitclone import clone_argv
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.model.api import CreateSandbox
from slicebox.model.config import parse_config
from slicebox.model.errors import InvalidRequest
from slicebox.model.exec import ExecRequest, ExecState, OutputStream, StreamChunk
from slicebox.model.spec import GitCredential, MountKind, SandboxSpec, Workspace, parse_spec
from tests.fakes.docker import FakeDocker
from tests.fakes.systemd import FakeSystemd
from tests.fakes.threadside import created
from tests.unit.test_sandboxes import FakeBinds

TOKEN = "ghp_s3cr3tTOKENvalue"
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
HOST = "git.internal:8418"
URL = f"http://{HOST}/demo.git"


def askpass(tmp_path: Path, prompt: str, hosts: tuple[str, ...] = ()) -> tuple[int, str]:
    store = CredentialStore(tmp_path)
    directory = store.write("sbx-1", GitCredential(token=TOKEN, username="bot", hosts=hosts))
    ran = subprocess.run(
        ["sh", str(directory / "askpass"), prompt], capture_output=True, text=True, check=False
    )
    store.remove("sbx-1")
    return ran.returncode, ran.stdout


@pytest.mark.parametrize(
    ("prompt", "hosts", "answer"),
    [
        ("Username for 'http://git.internal:8418': ", (), (0, "bot\n")),
        ("Password for 'http://bot@git.internal:8418': ", (), (0, TOKEN + "\n")),
        (
            "Password for 'http://bot@git.internal:8418': ",
            ("git.internal:8418",),
            (0, TOKEN + "\n"),
        ),
        ("Password for 'https://bot@elsewhere/x': ", ("git.internal:8418",), (1, "")),
        ("Username for 'https://elsewhere': ", ("git.internal:8418",), (1, "")),
        ("Are you sure you want to continue connecting?", (), (1, "")),
    ],
)
def test_the_askpass_helper_answers_git_for_the_allowed_hosts_only(
    tmp_path: Path, prompt: str, hosts: tuple[str, ...], answer: tuple[int, str]
) -> None:
    assert askpass(tmp_path, prompt, hosts) == answer


def test_the_helper_hands_the_token_to_no_program() -> None:
    lines = [line.strip() for line in ASKPASS_SCRIPT.splitlines()]
    assert all("token" not in line or line.startswith(("Password*)", "#")) for line in lines)
    assert "cat " not in ASKPASS_SCRIPT, "builtins only: the token is in no argv"


def test_the_credential_directory_is_private_and_goes_whole(tmp_path: Path) -> None:
    store = CredentialStore(tmp_path)
    directory = store.write("sbx-1", GitCredential(token=TOKEN))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}
    assert modes == {
        "askpass": 0o500,
        "token": 0o400,
        "username": 0o400,
        "hosts": 0o400,
        "user": 0o400,
    }
    assert store.remove("sbx-1")
    assert not directory.exists()
    assert not store.remove("sbx-1")


@pytest.mark.parametrize(
    ("fields", "argv_tail"),
    [
        ({"ref": "main"}, (URL, "main", "--depth=1", "")),
        ({"depth": 0}, (URL, "", "", "")),
        ({"ref": "a" * 40, "depth": 5}, (URL, "a" * 40, "--depth=5", "yes")),
    ],
)
def test_the_clone_takes_url_and_ref_as_arguments(
    fields: dict[str, object], argv_tail: tuple[str, ...]
) -> None:
    workspace = Workspace.model_validate({"kind": "git", "url": URL, **fields})
    argv = clone_argv(workspace)
    assert argv[:2] == ("sh", "-c")
    assert argv[3:] == ("/workspace", *argv_tail)
    assert URL not in argv[2], "never inside the script"


@pytest.mark.parametrize(
    ("workspace", "said"),
    [
        ({"kind": "git", "url": f"http://bot:{TOKEN}@git.internal/x.git"}, "carries no user"),
        ({"kind": "git", "url": "file:///etc"}, "http:// or https://"),
        ({"kind": "git"}, "needs 'url'"),
        ({"kind": "git", "url": URL, "name": "n"}, "name not for a git workspace"),
        ({"kind": "volume", "url": URL}, "url not for a volume workspace"),
    ],
)
def test_a_bad_git_workspace_is_refused_without_echoing_the_url(
    workspace: dict[str, object], said: str
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        parse_spec({"user": "u", "project": "p", "workspace": workspace})
    error = raised.value
    assert error.code == "invalid_workspace"
    assert said in error.message
    assert TOKEN not in error.message


class CloningDocker(FakeDocker):
    """A fake Docker whose execs are the clone: each answers ``code`` with ``stderr``."""

    def __init__(self, code: int = 0, stderr: bytes = b"") -> None:
        super().__init__(FakeSystemd())
        self.code, self.stderr = code, stderr
        self.ran: list[ExecRequest] = []

    def make_exec(self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False) -> str:
        self.sandbox_pid(backend_id)
        self.ran.append(request)
        return f"exec-{len(self.ran)}"

    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> _Said:
        return _Said([StreamChunk(stream=OutputStream.STDERR, data=self.stderr)])

    def exec_state(self, exec_id: str) -> ExecState:
        return ExecState(pid=5, running=False, exit_code=self.code)


class _Said:
    def __init__(self, chunks: list[StreamChunk]) -> None:
        self._chunks: list[list[StreamChunk] | None] = [chunks, None]

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        return self._chunks.pop(0)

    def close(self) -> None:
        pass


def manager(docker: FakeDocker, state_dir: Path) -> SandboxManager:
    ids = (f"sbx-{n:012x}" for n in itertools.count(1))
    config = parse_config(
        f'allowed_networks = ["none", "bridge"]\n[reaper]\nstate_dir = "{state_dir}"\n'
    )
    return SandboxManager(
        docker,
        SliceManager(docker.systemd),
        config=config,
        host_memory=4096 << 20,
        instance_id="run-1",
        clock=lambda: NOW,
        new_id=lambda: next(ids),
        binds=FakeBinds(),
    )


def git_spec(**fields: object) -> SandboxSpec:
    return SandboxSpec.model_validate(
        {
            "user": "al-ice",
            "project": "p",
            "network": "bridge",
            "workspace": {"kind": "git", "url": URL, "ref": "main"},
            "credentials": {"git": {"token": TOKEN, "hosts": ["git.internal:8418"]}},
            **fields,
        }
    )


def test_a_git_create_delivers_the_token_to_its_directory_only_and_clones(
    tmp_path: Path,
) -> None:
    docker = CloningDocker()
    sandboxes = manager(docker, tmp_path)
    box = created(sandboxes, git_spec())
    request: SandboxRequest = docker.requests[box.container_id]
    assert request.env == {"GIT_ASKPASS": ASKPASS, "GIT_TERMINAL_PROMPT": "0"}
    mounts = {m.target: m for m in request.mounts}
    assert mounts["/workspace"].kind is MountKind.VOLUME
    credentials = mounts[MOUNTED_AT]
    assert (credentials.kind, credentials.read_only) == (MountKind.BIND, True)
    assert credentials.source == str(tmp_path / box.id)
    assert (tmp_path / box.id / "token").read_text() == TOKEN + "\n"
    assert TOKEN not in request.model_dump_json(), "not in labels, env, argv or mounts"
    assert box.lineage.credentials == "git"
    assert [r.argv[3:5] for r in docker.ran] == [("/workspace", URL)]
    assert TOKEN not in str(docker.ran)
    sandboxes.destroy(box.id)
    assert not (tmp_path / box.id).exists(), "the credentials go with the sandbox"
    assert docker.volume_table == {}


def test_a_failed_clone_says_why_without_the_token_and_leaves_nothing(tmp_path: Path) -> None:
    docker = CloningDocker(128, f"fatal: Authentication failed for {TOKEN}\n".encode())
    sandboxes = manager(docker, tmp_path)
    with pytest.raises(InvalidRequest) as failed:
        created(sandboxes, git_spec())
    assert failed.value.code == "git_clone_failed"
    assert "Authentication failed" in failed.value.message
    assert TOKEN not in failed.value.message
    assert docker.containers == {}
    assert docker.volume_table == {}
    assert list(tmp_path.iterdir()) == []


def test_the_token_is_masked_in_every_dump_but_the_clients_request_body(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    argv = ["create", "--workspace", f"git:{URL}#main", "--git-token-file", str(token_file)]
    options = cli.build_parser().parse_args([*argv, "--git-host", HOST])
    spec = cli._spec(options)
    assert spec.workspace is not None
    assert (spec.workspace.url, spec.workspace.ref) == (URL, "main")
    assert spec.credentials is not None
    assert spec.credentials.git is not None
    assert spec.credentials.git.hosts == (HOST,)
    assert TOKEN not in spec.model_dump_json()
    assert TOKEN not in repr(spec)
    assert TOKEN not in str(spec.model_dump())
    sent = json.loads(wire.create(spec).body or b"")
    assert sent["credentials"]["git"]["token"] == TOKEN
    assert CreateSandbox.model_validate(sent).credentials == spec.credentials


def test_a_token_on_its_own_without_a_file_is_refused() -> None:
    options = cli.build_parser().parse_args(["create", "--git-username", "bot"])
    with pytest.raises(InvalidRequest, match="need --git-token-file"):
        cli._spec(options)
