"""The daytona backend's contract, with the real SDK against a local stand-in of the API.

No call of the SDK is mocked: the backend's client talks HTTP to ``tests.fakes.daytona``, whose
answers are the SDK's own API models, and the stand-in runs each exec with ``sh -c`` in the
sandbox's own directory, so what an exec prints and exits with is what the command did.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from slicebox.backends.base import SandboxRequest, SandboxState
from slicebox.backends.daytona import (
    NAME_LABEL,
    NO_SDK,
    DaytonaBackend,
    exec_script,
    import_sdk,
    is_daytona_exec,
    is_daytona_id,
    resources_of,
    state_of,
)
from slicebox.backends.daytona import backend as backend_module  # where the create reads its setup
from slicebox.core.blocking import on_core_loop
from slicebox.model.errors import (
    InvalidRequest,
    SandboxNotFound,
    SliceboxError,
    Unavailable,
)
from slicebox.model.exec import ExecRequest, StreamChunk
from slicebox.model.limits import INFINITY, Limits
from slicebox.model.spec import Backend
from tests.fakes.daytona import FAILING_IMAGE, StandIn, running

KEY = "dtn_test-key-0123456789abcdef"  # a secret: never in a message, a detail or a repr
ALICE = {"slicebox.user": "alice", "slicebox.project": "p1", "slicebox.expires_at": "1700000000"}


T = TypeVar("T")


@pytest.fixture(scope="module", autouse=True)
def _sdk_imported() -> None:
    """The SDK's import (most of a second) is paid once, not by the first test's clock."""
    sdk = import_sdk()
    assert sdk.AsyncDaytona is not None


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    with running(KEY) as served:
        yield served


Make = Callable[..., DaytonaBackend]


@pytest.fixture
def make() -> Iterator[Make]:
    """Makes backends whose blocking calls are awaited on the core loop, as the agent's are;
    their clients are closed after the test."""
    made: list[DaytonaBackend] = []

    def maker(api_url: str, api_key: str = KEY, target: str | None = None) -> DaytonaBackend:
        made.append(DaytonaBackend(api_url, api_key, target, portal=on_core_loop))
        return made[-1]

    yield maker
    for backend in made:
        on_core_loop(backend.aclose)


@pytest.fixture
def backend(stand_in: StandIn, make: Make) -> DaytonaBackend:
    return make(stand_in.api_url, target="us")


def request(name: str = "sbx-0a1b2c", **changes: object) -> SandboxRequest:
    fields: dict[str, object] = {
        "name": name,
        "image": "debian:12",
        "command": ("sleep", "infinity"),
        "labels": dict(ALICE),
        "slice": "slicebox-alice-p1.slice",
        "limits": Limits(cpus=1.5, memory_bytes=1536 * 2**20, pids=256),
        "env": {"GREETING": "hello"},
    }
    fields.update(changes)
    return SandboxRequest.model_validate(fields)


def output(chunks: list[StreamChunk]) -> bytes:
    return b"".join(chunk.data for chunk in chunks)


def awaited(backend: DaytonaBackend, make: Callable[[], Awaitable[T]]) -> T:
    """``make()`` awaited on a loop of its own, whose asyncio client is closed after."""

    async def main() -> T:
        try:
            return await make()
        finally:
            await backend.aclose()

    return asyncio.run(main())


def run(
    backend: DaytonaBackend, backend_id: str, exec_request: ExecRequest, stdin: bytes = b""
) -> tuple[bytes, int | None]:
    async def main() -> tuple[bytes, int | None]:
        exec_id = await backend.exec_create(backend_id, exec_request)
        attachment = await backend.exec_start(exec_id, stdin)
        chunks: list[StreamChunk] = []
        while (read := await attachment.read(5)) is not None:
            chunks += read
        attachment.close()
        state = await backend.exec_inspect(exec_id)
        assert not state.running
        return output(chunks), state.exit_code

    return awaited(backend, main)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- availability -------------------------------------------------------------------------------


def test_available_against_the_api(backend: DaytonaBackend) -> None:
    answer = backend.availability()
    assert answer.available
    assert answer.kind is Backend.DAYTONA
    assert backend.kind is Backend.DAYTONA


def test_unavailable_when_nothing_listens_says_what_to_check(make: Make) -> None:
    backend = make(f"http://127.0.0.1:{closed_port()}/api")
    answer = backend.availability()
    assert not answer.available
    assert "check the API URL" in answer.detail
    assert KEY not in answer.detail


def test_a_wrong_key_is_unavailable_and_never_shown(stand_in: StandIn, make: Make) -> None:
    backend = make(stand_in.api_url, KEY + "-wrong")
    answer = backend.availability()
    assert not answer.available
    assert KEY not in answer.detail
    with pytest.raises(Unavailable) as raised:
        backend.find(ALICE)
    assert raised.value.code == "backend_unavailable"
    assert KEY not in str(raised.value)
    assert KEY not in repr(backend)


# --- lifecycle ----------------------------------------------------------------------------------


def test_create_sends_labels_env_resources_and_no_network(
    backend: DaytonaBackend, stand_in: StandIn
) -> None:
    info = backend.create(request())

    assert is_daytona_id(info.id)
    assert info.name == "sbx-0a1b2c"
    assert info.labels == ALICE
    assert info.state is SandboxState.RUNNING
    sent = stand_in.creates[0]
    assert sent.labels is not None
    assert {**ALICE, NAME_LABEL: "sbx-0a1b2c"}.items() <= sent.labels.items()
    assert sent.env == {"GREETING": "hello"}
    assert sent.network_block_all is True
    assert (sent.cpu, sent.memory) == (2, 2)  # 1.5 CPUs and 1.5 GiB, rounded up
    assert sent.build_info is not None
    assert "FROM debian:12" in sent.build_info.dockerfile_content
    assert sent.target == "us"


def test_find_by_a_subset_of_labels_gives_all_of_them(backend: DaytonaBackend) -> None:
    mine = backend.create(request("sbx-alice"))
    backend.create(request("sbx-bob", labels={**ALICE, "slicebox.user": "bob"}))

    found = backend.find({"slicebox.user": "alice"})
    assert [(info.id, info.labels) for info in found] == [(mine.id, ALICE)]
    assert backend.find({"slicebox.user": "alice", "slicebox.project": "p2"}) == []
    assert {info.name for info in backend.find({"slicebox.project": "p1"})} == {
        "sbx-alice",
        "sbx-bob",
    }


def test_inspect_by_id_or_name(backend: DaytonaBackend) -> None:
    info = backend.create(request())

    assert awaited(backend, lambda: backend.inspect(info.id)) == info
    assert awaited(backend, lambda: backend.inspect("sbx-0a1b2c")) == info
    missing = "daytona-00000000-0000-0000-0000-000000000000"
    assert awaited(backend, lambda: backend.inspect(missing)) is None
    assert awaited(backend, lambda: backend.inspect("sbx-nobody")) is None


def test_remove_twice_is_true_then_false(backend: DaytonaBackend, stand_in: StandIn) -> None:
    info = backend.create(request())

    assert backend.remove(info.id) is True
    assert backend.remove(info.id) is False
    assert stand_in.boxes == {}
    assert awaited(backend, lambda: backend.inspect(info.id)) is None


def test_a_sandbox_that_fails_to_start_leaves_nothing(
    backend: DaytonaBackend, stand_in: StandIn
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        backend.create(request(image=FAILING_IMAGE))

    assert raised.value.code == "container_start_failed"
    assert len(stand_in.creates) == 1  # it was made remotely, then deleted
    assert stand_in.boxes == {}


def test_a_failure_after_the_create_deletes_the_sandbox(
    backend: DaytonaBackend, stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend_module, "WORKSPACE_SETUP", "echo no room >&2; exit 1")

    with pytest.raises(InvalidRequest) as raised:
        backend.create(request())

    assert raised.value.code == "container_start_failed"
    assert "no room" in raised.value.message
    assert len(stand_in.creates) == 1
    assert stand_in.boxes == {}


@pytest.mark.parametrize("network", ["bridge", "host", "egress"])
def test_a_network_other_than_none_is_refused(
    backend: DaytonaBackend, stand_in: StandIn, network: str
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        backend.create(request(network=network))

    assert raised.value.code == "backend_unsupported"
    assert 'only supports network "none"' in raised.value.message
    assert stand_in.creates == []


def test_usage_is_what_daytona_allocated(backend: DaytonaBackend) -> None:
    info = backend.create(request())

    assert backend.usage(info.id) == {
        "cpus": 2.0,
        "memory_bytes": float(2 * 2**30),
        "disk_bytes": float(3 * 2**30),  # the stand-in's default disk, as Daytona's
    }
    with pytest.raises(SandboxNotFound):
        backend.usage("daytona-00000000-0000-0000-0000-000000000000")


def test_no_volumes_no_pid_no_launch(backend: DaytonaBackend) -> None:
    assert backend.volume("v") is None
    assert backend.volumes(ALICE) == []
    assert backend.remove_volume("v") is False
    with pytest.raises(InvalidRequest, match="no volumes") as raised:
        backend.create_volume("v", ALICE)
    assert raised.value.code == "backend_unsupported"
    with pytest.raises(InvalidRequest) as raised:
        backend.sandbox_pid("daytona-x")
    assert raised.value.code == "backend_unsupported"
    with pytest.raises(InvalidRequest) as raised:
        asyncio.run(backend.launch_async("daytona-x", b""))
    assert raised.value.code == "backend_unsupported"


# --- exec ---------------------------------------------------------------------------------------


def test_exec_echo_exit_code_and_stdin(backend: DaytonaBackend) -> None:
    info = backend.create(request())

    assert run(backend, info.id, ExecRequest(argv=("echo", "hi"))) == (b"hi\n", 0)
    assert run(backend, info.id, ExecRequest(argv=("sh", "-c", "exit 3"))) == (b"", 3)
    assert run(backend, info.id, ExecRequest(argv=("cat",)), b"piped\0bytes\n") == (
        b"piped\0bytes\n",
        0,
    )


def test_exec_env_cwd_and_quoting(backend: DaytonaBackend) -> None:
    info = backend.create(request())
    argv = ("sh", "-c", 'printf "%s|%s|%s\\n" "$GREETING" "$ONE" "$1"; pwd', "sh", "it's a $word")

    out, code = run(backend, info.id, ExecRequest(argv=argv, env={"ONE": "1"}))
    assert code == 0
    said, cwd = out.decode().split("\n")[:2]
    assert said == "hello|1|it's a $word"
    assert cwd.endswith("/workspace")
    out, code = run(backend, info.id, ExecRequest(argv=("true",), cwd="/nowhere"))
    assert code == 126


def test_files_ride_on_stdin_into_the_workspace(backend: DaytonaBackend) -> None:
    info = backend.create(request())
    data = bytes(range(256)) * 64

    assert run(backend, info.id, ExecRequest(argv=("sh", "-c", "cat > f.bin")), data) == (b"", 0)
    out, code = run(backend, info.id, ExecRequest(argv=("sh", "-c", "wc -c < f.bin; ls -A /tmp")))
    assert code == 0
    assert out.split()[0] == str(len(data)).encode()
    assert b".slicebox-stdin" not in out  # read and gone


def test_exec_on_the_event_loop_with_a_streamed_stdin(backend: DaytonaBackend) -> None:
    info = backend.create(request())

    class Source:
        def __init__(self, chunks: list[bytes]) -> None:
            self.chunks = chunks

        async def read(self) -> bytes:
            return self.chunks.pop(0) if self.chunks else b""

    async def scenario() -> tuple[bytes, int | None, bool]:
        try:
            exec_id = await backend.exec_create(
                info.id, ExecRequest(argv=("sh", "-c", "cat; exit 3")), streamed_stdin=True
            )
            assert is_daytona_exec(exec_id)
            assert (await backend.exec_inspect(exec_id)).exit_code is None
            attachment = await backend.exec_start(exec_id, Source([b"one ", b"two"]))
            chunks: list[StreamChunk] = []
            while (read := await attachment.read(5)) is not None:
                chunks += read
            attachment.close()
            state = await backend.exec_inspect(exec_id)
            return output(chunks), state.exit_code, state.running
        finally:
            await backend.aclose()

    assert asyncio.run(scenario()) == (b"one two", 3, False)


def test_an_exec_that_fails_after_its_stdin_went_up_leaves_no_stdin_file(
    backend: DaytonaBackend, stand_in: StandIn
) -> None:
    info = backend.create(request())
    stand_in.execute_fails = True
    with pytest.raises(SliceboxError):
        run(backend, info.id, ExecRequest(argv=("cat",)), b"secret input")

    async def on_the_loop() -> None:
        try:
            exec_id = await backend.exec_create(info.id, ExecRequest(argv=("cat",)))
            attachment = await backend.exec_start(exec_id, b"secret input")
            while await attachment.read(5) is not None:
                pass
        finally:
            await backend.aclose()

    with pytest.raises(SliceboxError):
        asyncio.run(on_the_loop())
    stand_in.execute_fails = False
    # The stand-in runs commands on this host: the sandbox's /tmp is ``tmp`` in its directory.
    out, code = run(backend, info.id, ExecRequest(argv=("ls", "-A", "tmp"), cwd="/"))
    assert (out, code) == (b"", 0), "each upload was made, and removed again"


def test_kill_ends_a_running_exec(backend: DaytonaBackend) -> None:
    info = backend.create(request())

    async def scenario() -> tuple[bool, int | None, bool]:
        try:
            exec_id = await backend.exec_create(info.id, ExecRequest(argv=("sleep", "30")))
            attachment = await backend.exec_start(exec_id, b"")
            assert await attachment.read(0.3) == []
            killed = await backend.exec_kill(exec_id)
            while await attachment.read(5) is not None:
                pass
            state = await backend.exec_inspect(exec_id)
            again = await backend.exec_kill(exec_id)
            return killed, state.exit_code, again
        finally:
            await backend.aclose()

    assert asyncio.run(scenario()) == (True, 137, False)


def test_exec_in_a_missing_sandbox(backend: DaytonaBackend) -> None:
    missing = "daytona-00000000-0000-0000-0000-000000000000"
    with pytest.raises(SandboxNotFound):
        awaited(backend, lambda: backend.exec_create(missing, ExecRequest(argv=("true",))))
    with pytest.raises(SandboxNotFound):
        awaited(backend, lambda: backend.exec_inspect("daytona-exec-unknown"))


# --- the SDK missing ----------------------------------------------------------------------------


def test_without_the_sdk_it_is_unavailable(
    stand_in: StandIn, make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "daytona", None)  # what an import of a missing one does
    backend = make(stand_in.api_url)

    answer = backend.availability()
    assert not answer.available
    assert answer.detail == NO_SDK
    calls: list[Callable[[], object]] = [
        lambda: backend.create(request()),
        lambda: asyncio.run(backend.inspect("daytona-x")),
        lambda: backend.find(ALICE),
        lambda: backend.remove("daytona-x"),
        lambda: asyncio.run(backend.exec_create("daytona-x", ExecRequest(argv=("true",)))),
    ]
    for call in calls:
        with pytest.raises(Unavailable) as raised:
            call()
        assert raised.value.code == "backend_unavailable"
        assert "install slicebox[daytona]" in raised.value.message


# --- pure parts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("daytona_state", "state"),
    [
        ("started", SandboxState.RUNNING),
        ("stopped", SandboxState.EXITED),
        ("error", SandboxState.DEAD),
        ("creating", SandboxState.CREATED),
        ("starting", SandboxState.CREATED),
        ("destroyed", SandboxState.REMOVING),
        ("unknown", SandboxState.UNKNOWN),
        ("something_new", SandboxState.UNKNOWN),
        (None, SandboxState.UNKNOWN),
    ],
)
def test_states(daytona_state: str | None, state: SandboxState) -> None:
    assert state_of(daytona_state) is state


def test_resources_round_up_and_leave_out_what_is_unlimited() -> None:
    assert resources_of(Limits(cpus=0.25, memory_bytes=2**30, pids=1)) == {"cpu": 1, "memory": 1}
    assert resources_of(Limits(cpus=2, memory_bytes=2**30 + 1, pids=1)) == {"cpu": 2, "memory": 2}
    assert resources_of(Limits(cpus=0, memory_bytes=INFINITY, pids=1)) == {}


def test_ids() -> None:
    assert is_daytona_id("daytona-0a1b")
    assert not is_daytona_id("daytona-exec-1")
    assert is_daytona_exec("daytona-exec-1")
    assert not is_daytona_id("0a1b2c3d4e5f")
    assert not is_daytona_id("slicebox-alice-p-sbx.slice")


def test_the_wrapper_names_no_absolute_path_but_its_stdin_file() -> None:
    script = exec_script("daytona-exec-1", ExecRequest(argv=("ls", "-l")), "/tmp/in")
    assert "./tmp/in" in script
    assert "./workspace" in script
    assert script.endswith("sh ls -l")


def test_errors_never_carry_the_key(stand_in: StandIn, make: Make) -> None:
    backend = make(stand_in.api_url, KEY + "-wrong")
    for call in (lambda: backend.create(request()), lambda: backend.remove("daytona-x")):
        with pytest.raises(SliceboxError) as raised:
            call()
        assert KEY not in str(raised.value)
