"""``GET /v1/capacity`` over fakes: ``fits`` follows admission exactly (n creates of the shape
are admitted, the next is refused ``admission_refused``) over many shapes, ceilings and
sandboxes already placed; creates in flight count, and what the reaper's listing says; a bad
shape gets the create's own code; another user's capacity is nobody else's; and the route, both
clients and the CLI answer it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlencode

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from slicebox.backends.base import SandboxInfo, SandboxRequest
from slicebox.cli import main as cli
from slicebox.client import AsyncClient, Client
from slicebox.core.blocking import inline
from slicebox.core.capacity import Capacities
from slicebox.core.commitments import Commitments, Listed
from slicebox.core.headroom import Ratios, amounts, fit, levels
from slicebox.core.policy import Admitted, place
from slicebox.host.meminfo import parse_meminfo
from slicebox.model import errors
from slicebox.model.api import CreateSandbox, ReapRequest
from slicebox.model.capacity import Capacity, CapacityQuery, HostMemory, Resource
from slicebox.model.config import parse_config
from slicebox.model.errors import AdmissionRefused, NotFound, SliceboxError
from slicebox.model.limits import Limits
from slicebox.model.names import slice_names
from slicebox.model.spec import SandboxSpec
from slicebox.model.usage import Level
from slicebox.model.validation import refusal
from tests.fakes.threadside import ThreadSide
from tests.unit.agentserver import Agent, served
from tests.unit.test_pool import POOL
from tests.unit.test_pool import World as PoolWorld
from tests.unit.test_service import ALICE, BOB, ORCH, World, on_loop

T = TypeVar("T")
MiB = 1024 * 1024
COUNTING = """
[project]
memory = "512MB"
pids = 300
[admission]
memory_ratio = 1.0
pids_ratio = 1.0
cpus_ratio = 2.0
"""


def counting(world: World, text: str = COUNTING) -> World:
    world.sandboxes.reconfigure(parse_config(text))
    return world


def ask(world: World, who: object = ALICE, **query: object) -> Capacity:
    """The service's answer to a query string's fields, parsed as the route parses them."""
    try:
        parsed = CapacityQuery.model_validate({"project": "web", **query})
    except ValidationError as exc:
        raise refusal(exc) from exc
    return ThreadSide(world.service).capacity(who, parsed)  # type: ignore[arg-type]


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def attempt(call: Callable[[], T]) -> T | SliceboxError:
    """The call's answer, or the slicebox error it raised."""
    try:
        return call()
    except SliceboxError as exc:
        return exc


def create(world: World, who: object = ALICE, **shape: object) -> str:
    request = CreateSandbox.model_validate({"project": "web", **shape})
    return ThreadSide(world.service).create(who, request).id  # type: ignore[arg-type]


# --- fits follows admission, over many cases --------------------------------------------------

shapes = st.fixed_dictionaries(
    {
        "memory": st.integers(24, 256).map(lambda n: f"{n}MB") | st.integers(24 * MiB, 256 * MiB),
        "cpus": st.sampled_from([0.1, 0.25, 0.5, 1.0, 1.5]) | st.sampled_from(["0.3", "2"]),
        "pids": st.integers(20, 200) | st.integers(20, 200).map(str),
    }
)
ratios = st.none() | st.sampled_from([0.5, 1.0, 1.5, 2.0])


@st.composite
def setups(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, str, dict[str, object]]]]:
    """(ceilings, [admission], sandboxes placed before counting starts: user, project, shape)."""
    ceilings: dict[str, dict[str, object]] = {
        "managed": {"memory": draw(st.sampled_from(['"75%"', '"1GB"', '"600MB"']))},
        "user": {
            "memory": draw(st.none() | st.integers(128, 1024).map(lambda n: f'"{n}MB"')),
            "pids": draw(st.none() | st.integers(100, 600)),
        },
        "project": {
            "memory": draw(st.integers(64, 640).map(lambda n: f'"{n}MB"')),
            "pids": draw(st.integers(50, 500)),
            "cpus": draw(st.none() | st.sampled_from([0.5, 1, 1.5, 4])),
        },
    }
    text = "".join(
        f"[{level}]\n" + "".join(f"{k} = {v}\n" for k, v in fields.items() if v is not None)
        for level, fields in ceilings.items()
    )
    memory, pids, cpus = draw(ratios), draw(ratios), draw(ratios)
    admission = "[admission]\n" + "".join(
        f"{name}_ratio = {ratio}\n"
        for name, ratio in (("memory", memory), ("pids", pids), ("cpus", cpus))
        if ratio is not None
    )
    placed: list[tuple[str, str, dict[str, object]]] = draw(
        st.lists(
            st.tuples(st.sampled_from(["alice", "bob"]), st.sampled_from(["web", "api"]), shapes),
            max_size=5,
        )
    )
    return text, admission, placed


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
@given(setup=setups(), shape=shapes)
def test_fits_n_means_n_creates_are_admitted_and_the_next_is_refused(
    tmp_path: Path,
    setup: tuple[str, str, list[tuple[str, str, dict[str, object]]]],
    shape: dict[str, object],
) -> None:
    ceilings, admission, placed = setup
    world = counting(World(tmp_path), ceilings)
    for user, project, each in placed:  # placed before the operator counts: maybe overfull
        # One whose own limits exceed a ceiling is refused whatever is counted.
        with contextlib.suppress(AdmissionRefused):
            create(world, ORCH, user=user, project=project, **each)
    counting(world, ceilings + admission)
    answer = attempt(lambda: ask(world, **shape))
    if isinstance(answer, SliceboxError):
        event(f"refused {answer.code}")
        with pytest.raises(SliceboxError) as made:
            create(world, **shape)
        assert (made.value.code, made.value.field) == (answer.code, answer.field)
        return
    event("unbounded" if answer.fits is None else f"fits {min(answer.fits, 21)}")
    if answer.fits is None:  # nothing counted bounds it: admitted, as often as asked
        for _ in range(3):
            create(world, **shape)
        assert ask(world, **shape).fits is None
        return
    assume(answer.fits <= 20)
    for done in range(1, answer.fits + 1):
        create(world, **shape)
        assert ask(world, **shape).fits == answer.fits - done, "each create takes one"
    with pytest.raises(AdmissionRefused) as refused:
        create(world, **shape)
    assert answer.bound is not None
    assert refused.value.field in {r.value for r in Resource}
    last = ask(world, **shape)
    assert last.fits == 0
    assert last.bound is not None
    assert refused.value.field == last.bound.resource.value, "the refusal names what ran out"
    assert f"{last.bound.level.value} " in refused.value.message


def test_the_levels_say_what_is_provisioned_admitted_and_left(world: World) -> None:
    counting(world)
    create(world, memory="100MB", cpus=0.5, pids=50)
    create(world, ORCH, user="alice", project="api", memory="64MB", cpus=1, pids=20)
    create(world, ORCH, user="bob", memory="32MB", cpus=0.25, pids=10)
    answer = ask(world, memory="128MB", cpus=0.5, pids=40)
    managed, user, project = answer.levels
    assert [level.level for level in answer.levels] == [Level.MANAGED, Level.USER, Level.PROJECT]
    assert (managed.sandboxes, user.sandboxes, project.sandboxes) == (3, 2, 1)
    assert project.unit == "slicebox-alice-web.slice"
    assert project.memory.model_dump() == {
        "ceiling": 512 * MiB,
        "admits": 512 * MiB,
        "provisioned": 100 * MiB,
        "left": 412 * MiB,
    }
    assert (project.pids.provisioned, project.pids.left) == (50, 250)
    assert (project.cpus.ceiling, project.cpus.left) == (None, None), "no quota: no bound"
    assert user.memory.provisioned == 164 * MiB
    assert managed.memory.provisioned == 196 * MiB
    assert managed.cpus.provisioned == 1.75
    assert project.fits == 3  # 412 MiB / 128 MiB; pids 250 / 40 = 6
    assert answer.fits == 3
    assert answer.bound is not None
    assert (answer.bound.level, answer.bound.resource) == (Level.PROJECT, Resource.MEMORY)
    assert answer.counted == (Resource.MEMORY, Resource.PIDS, Resource.CPUS)
    assert answer.shape == Limits(cpus=0.5, memory_bytes=128 * MiB, pids=40)


def test_a_ratio_lets_the_limits_add_up_to_more_than_the_ceiling(world: World) -> None:
    counting(world, COUNTING.replace("memory_ratio = 1.0", "memory_ratio = 1.5"))
    answer = ask(world, memory="256MB", pids=10)
    assert answer.levels[2].memory.admits == 768 * MiB
    assert answer.fits == 3, "three of 256 MiB under 1.5 x 512 MiB"
    for _ in range(3):
        create(world, memory="256MB", pids=10)
    with pytest.raises(AdmissionRefused, match="project alice/web has 0 B left of the 768 MiB"):
        create(world, memory="256MB", pids=10)


def test_by_default_nothing_is_counted_and_the_kernel_shares_the_ceilings(world: World) -> None:
    """Issue 3's overcommitted project: three 200 MB sandboxes in a 400 MB project."""
    counting(world, '[project]\nmemory = "400MB"\n')
    assert ask(world, memory="200MB").fits is None
    for _ in range(3):
        create(world, memory="200MB")
    answer = ask(world, memory="200MB")
    assert (answer.fits, answer.bound, answer.counted) == (None, None, ())
    assert answer.levels[2].memory.provisioned == 600 * MiB
    assert answer.levels[2].memory.ceiling == 400 * MiB
    assert answer.levels[2].memory.left is None


def test_a_create_in_flight_counts_and_a_failed_one_gives_its_room_back(world: World) -> None:
    counting(world)
    started, go = threading.Event(), threading.Event()
    real = world.docker.create

    def slow(request: SandboxRequest) -> SandboxInfo:
        started.set()
        assert go.wait(10)
        return real(request)

    world.docker.create = slow  # type: ignore[method-assign]
    making = threading.Thread(target=create, args=(world,), kwargs={"memory": "400MB"})
    making.start()
    try:
        assert started.wait(10)
        during = ask(world, memory="100MB")
        assert during.levels[2].sandboxes == 1, "the create in flight is counted"
        assert during.levels[2].memory.provisioned == 400 * MiB
        assert during.fits == 1
        with pytest.raises(AdmissionRefused):
            create(world, memory="200MB")  # no two creates take the same room
    finally:
        go.set()
        making.join(10)
    world.docker.create = real  # type: ignore[method-assign]
    assert ask(world, memory="100MB").fits == 1, "made: it counts as it did in flight"
    world.docker.fail_start = True
    with pytest.raises(SliceboxError, match="cannot start"):
        create(world, memory="100MB")
    assert ask(world, memory="100MB").fits == 1, "the failed create's room is back"


def test_a_destroy_frees_its_room_and_a_removal_behind_the_agents_back_counts_until_a_pass(
    world: World,
) -> None:
    counting(world)
    first = create(world, memory="256MB")
    second = create(world, memory="256MB")
    assert ask(world, memory="256MB").fits == 0
    ThreadSide(world.service).destroy(ALICE, first)
    assert ask(world, memory="256MB").fits == 1
    world.docker.remove(world.sandboxes.get(second).container_id)  # its timer expired it
    assert ask(world, memory="256MB").fits == 1, "still counted: the agent did not see it go"
    ThreadSide(world.service).reap(ORCH, ReapRequest())
    assert ask(world, memory="256MB").fits == 2, "the reaper's listing says it is gone"


def test_a_restarted_agent_counts_what_its_first_pass_lists(world: World, tmp_path: Path) -> None:
    counting(world)
    create(world, memory="200MB")
    create(world, ORCH, user="alice", project="api", memory="100MB")
    before = ask(world, memory="100MB", pids=10)
    assert before.fits == 3
    restarted = counting(World(tmp_path, after=world))
    assert ask(restarted, memory="100MB", pids=10).fits == 5, "nothing known before a pass"
    ThreadSide(restarted.service).reap(ORCH, ReapRequest())  # the start-up pass
    after = ask(restarted, memory="100MB", pids=10)
    assert after.model_dump(exclude={"host"}) == before.model_dump(exclude={"host"})


def test_the_ledger_keeps_creates_in_flight_and_releases_a_listing_missed() -> None:
    ledger = Commitments()
    config = parse_config(COUNTING)
    placement = place("alice", "web", config, 4096 * MiB)
    names = slice_names("alice", "web")
    shape = Limits(cpus=0.5, memory_bytes=100 * MiB, pids=10)

    def held() -> int:
        return ledger.levels("alice", "web", placement)[2].used.sandboxes

    mark = ledger.mark()  # a listing begins
    ledger.sync([Listed("sbx-old", names, shape)], mark)
    assert held() == 1
    spec = SandboxSpec(user="alice", project="web")
    admitted = Admitted(spec=spec, image="alpine", limits=shape, placement=placement)
    mark = ledger.mark()
    ledger.reserve("sbx-new", admitted, Ratios(memory=1.0))  # in flight, after the mark
    ledger.release("sbx-old")  # destroyed after the listing began, which still shows it
    ledger.sync([Listed("sbx-old", names, shape)], mark)
    assert held() == 1, "the new one stays in flight; the old one is not counted again"
    ledger.made("sbx-new")
    ledger.sync([], ledger.mark())
    assert held() == 0, "made before a listing that does not show it: gone"


def test_the_arithmetic_is_exact_at_every_size() -> None:
    """No float rounds a ceiling times a ratio, nor a CPU quota: µs of CPU per second."""
    config = parse_config('[project]\nmemory = "1TB"\ncpus = 3\n')
    placement = place("alice", "web", config, 4 * 2**40)
    shape = Limits(cpus=1 / 3, memory_bytes=2**40 // 3, pids=1)
    used = (amounts(shape), amounts(shape), amounts(shape))
    project = levels("alice", "web", placement, used)[2:]
    found = fit(shape, project, Ratios(memory=1.0, cpus=1.0))
    assert found.fits == 2
    assert amounts(Limits(cpus=1e-9, memory_bytes=1, pids=1)).cpus == 1, "never a zero share"


# --- bad shapes get the create's codes ---------------------------------------------------------

BAD = [
    ({"memory": "lots"}, "invalid_limit", 400),
    ({"memory": "0"}, "invalid_limit", 400),
    ({"cpus": "-1"}, "invalid_limit", 400),
    ({"cpus": "nan"}, "invalid_limit", 400),
    ({"pids": "1.5"}, "invalid_limit", 400),
    ({"memory": "1GB"}, "admission_refused", 409),  # over the project's 512 MB
    ({"pids": "301"}, "admission_refused", 409),
    ({"project": "a/b"}, "invalid_name", 400),
    ({"project": "x" * 65}, "invalid_name", 400),
]


@pytest.mark.parametrize(("shape", "code", "status"), BAD)
def test_a_bad_shape_answers_the_code_a_create_of_it_gets(
    world: World, shape: dict[str, str], code: str, status: int
) -> None:
    counting(world)
    with pytest.raises(SliceboxError) as asked:
        ask(world, **shape)
    with pytest.raises(SliceboxError) as made:
        create(world, **shape)
    assert (asked.value.code, asked.value.http_status) == (code, status)
    assert (made.value.code, made.value.field) == (asked.value.code, asked.value.field)


def test_a_query_without_a_project_or_with_a_shape_and_a_pool_is_refused(world: World) -> None:
    with pytest.raises(errors.InvalidName, match="project: required"):
        ThreadSide(world.service).capacity(ALICE, CapacityQuery(memory="1GB"))
    with pytest.raises(NotFound, match="no pool"):
        ask(world, pool="0" * 24)
    with pytest.raises(errors.InvalidRequest, match="not both") as both:
        ask(world, pool="0" * 24, memory="1GB")
    assert (both.value.code, both.value.field) == ("invalid_field", "pool")


# --- who may see whose --------------------------------------------------------------------------


def test_another_users_capacity_is_not_found_for_everyone_but_admins(world: World) -> None:
    counting(world)
    create(world, ORCH, user="bob", memory="256MB")
    with pytest.raises(NotFound) as theirs:
        ask(world, ALICE, user="bob")
    with pytest.raises(NotFound) as nobody:
        ask(world, ALICE, user="nobody")
    assert theirs.value.message.replace("bob", "X") == nobody.value.message.replace(
        "nobody", "X"
    ), "another user's capacity reads exactly like a user's that does not exist"
    assert ask(world, ORCH, user="bob").levels[2].memory.provisioned == 256 * MiB
    assert ask(world, BOB).user == "bob", "their own, named or not"
    mine = ask(world, ALICE)
    assert (mine.user, mine.levels[2].sandboxes, mine.levels[0].sandboxes) == ("alice", 0, 1)


def test_a_pools_key_is_a_shape_and_its_ready_members_are_said(tmp_path: Path) -> None:
    world = PoolWorld(tmp_path, POOL + "[admission]\nmemory_ratio = 1.0\n")
    world.fill()
    [pool] = world.pool.stats().pools
    alice = ThreadSide(world.service)
    answer = alice.capacity(ALICE, CapacityQuery(pool=pool.fingerprint))
    assert (answer.project, answer.pool, answer.pool_ready) == ("web", pool.fingerprint, 2)
    assert answer.shape == pool.key.limits
    assert answer.levels[2].sandboxes == 2, "its idle members are in the project's slice"
    assert answer.fits == (1024 - 2 * 128) // 128
    with pytest.raises(NotFound):
        alice.capacity(BOB, CapacityQuery(pool=pool.fingerprint))
    with pytest.raises(NotFound):
        alice.capacity(ALICE, CapacityQuery(pool=pool.fingerprint, project="api"))


def test_the_hosts_available_memory_is_beside_fits_never_in_it(world: World) -> None:
    counting(world)
    tiny = HostMemory(total_bytes=64 * MiB, available_bytes=MiB)
    capacities = Capacities(world.sandboxes, None, meminfo=lambda: tiny)
    answer = on_loop(capacities.answer(ALICE, CapacityQuery(project="web"), inline))
    assert answer.host == tiny
    assert answer.fits == ask(world).fits == 2  # 512 MiB / 256 MiB: what admission counts


def test_meminfo_is_read_in_bytes_and_an_old_kernel_has_no_available() -> None:
    text = "MemTotal:        4015112 kB\nMemFree:   1 kB\nMemAvailable:    2000000 kB\n"
    assert parse_meminfo(text) == HostMemory(
        total_bytes=4015112 * 1024, available_bytes=2000000 * 1024
    )
    assert parse_meminfo("MemTotal: 8 kB\n").available_bytes is None


# --- the route, both clients and the CLI ----------------------------------------------------------


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    world = World(tmp_path)
    world.sandboxes.reconfigure(
        parse_config(COUNTING.replace("[project]", '[projects."root/web"]'))
    )
    with served(tmp_path, world) as running:
        yield running
        assert running.sandboxes() == [], "a test left a sandbox behind"


def get(agent: Agent, target: str) -> tuple[int, dict[str, object]]:
    head = f"GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(agent.socket)
        s.sendall(head.encode())
        answer = b"".join(iter(lambda: s.recv(65536), b""))
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_the_route_answers_its_model_and_bad_shapes_their_codes(agent: Agent) -> None:
    status, body = get(agent, "/v1/capacity?project=web&memory=256MB&cpus=0.5&pids=100")
    assert status == 200
    answer = Capacity.model_validate(body)
    assert (answer.user, answer.fits) == ("root", 2)
    for query, code, wanted in [
        ("project=web&memory=lots", "invalid_limit", 400),
        ("project=web&memory=1GB", "admission_refused", 409),
        ("project=web&colour=red", "invalid_field", 400),
        ("project=web&pool=xyz", "invalid_field", 400),
        ("memory=1GB", "invalid_name", 400),
    ]:
        status, body = get(agent, f"/v1/capacity?{query}")
        assert (status, body["code"]) == (wanted, code), query
    status, body = get(agent, "/v1/capacity?project=web&user=someone")
    assert (status, body["user"]) == (200, "someone"), "root is an admin: anyone's is its to see"


def test_both_clients_ask_and_the_answer_follows_their_creates(agent: Agent) -> None:
    client = Client(agent.socket)
    query = CapacityQuery(project="web", memory=256 * MiB)
    assert client.capacity(query).fits == 2
    box = client.create(CreateSandbox(project="web", memory="256MB"))

    async def asked() -> Capacity:
        async with AsyncClient(agent.socket) as aio:
            return await aio.capacity(query)

    assert asyncio.run(asked()).fits == 1
    with pytest.raises(errors.InvalidLimit):
        client.capacity(CapacityQuery(project="web", cpus="many"))
    client.destroy(box.id)


def test_the_cli_prints_a_table_or_the_json(
    agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--socket", agent.socket, "capacity", "--project", "web", "--memory", "128MB"]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "root/web, sandboxes of 128 MiB, 0.5 CPUs, 100 pids:" in table
    assert "fits: 3 more (project pids runs out first)" in table
    assert "slicebox-root-web.slice" in table
    assert "not counted by admission" in table
    assert cli.main(["--json", *argv]) == 0
    assert Capacity.model_validate_json(capsys.readouterr().out).fits == 3
    assert cli.main([*argv[:5], "--memory", "lots"]) == 2
    assert "invalid_limit" in capsys.readouterr().err


query_values = st.text(max_size=12) | st.integers(-(10**30), 10**30).map(str) | st.just("9" * 400)
queries = st.dictionaries(
    st.sampled_from(["project", "user", "memory", "cpus", "pids", "pool", "other"]),
    query_values,
    max_size=5,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(fields=queries)
def test_no_query_gets_a_500(agent: Agent, fields: dict[str, str]) -> None:
    status, body = get(agent, "/v1/capacity?" + urlencode(fields))
    assert status in (200, 400, 404, 409), body
    if status != 200:
        assert set(body) >= {"code", "message"}
