from __future__ import annotations

import pytest

from slicebox.core.deadlines import described, description
from slicebox.model.config import parse_config
from slicebox.model.errors import ConfigError
from slicebox.model.limits import Limits
from slicebox.model.pool import Lease, PoolKey, parse_lease

POOL = '[[pool]]\nuser = "al-ice"\nproject = "p"\nsize = 3\n'


def test_pools_are_declared_as_tables_with_the_defaults_of_a_request() -> None:
    config = parse_config(POOL + 'memory = "128MB"\nidle_timeout_seconds = 60\n')
    (pool,) = config.pool
    assert (pool.user, pool.project, pool.size, pool.memory) == ("al-ice", "p", 3, "128MB")
    assert (pool.network, pool.image, pool.reuse, pool.idle_timeout_seconds) == (
        "none",
        None,
        False,
        60.0,
    )


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ('memory = "lots"\n', "pool.0.memory", "is not a size"),
        ("size = 0\n", "pool.0.size", "greater than or equal to 1"),
        ('network = "host"\n', "pool", "not in allowed_networks"),
        ('run_as = "0:0"\n', "pool.0.run_as", "pattern"),
        ("colour = 1\n", "pool.0.colour", "not a known field"),
    ],
)
def test_a_bad_pool_table_is_refused_naming_its_field(extra: str, field: str, words: str) -> None:
    text = POOL.replace("size = 3\n", "") + ("size = 3\n" if "size" not in extra else "") + extra
    with pytest.raises(ConfigError) as refused:
        parse_config(text)
    assert refused.value.field == field
    assert words in refused.value.message


def test_a_pool_for_an_unmappable_project_or_twice_the_same_is_refused() -> None:
    with pytest.raises(ConfigError, match="project name 'b/c' is not allowed"):
        parse_config(POOL.replace('"p"', '"b/c"'))
    with pytest.raises(ConfigError, match="repeats an earlier"):
        parse_config(POOL + POOL)


def test_a_lease_survives_a_unit_description_and_a_foreign_one_is_no_lease() -> None:
    lease = Lease(task_id="t1", root_task_id="r:1", parent_id="sbx-9", depth=2, oneshot=True)
    text = description("sbx-1", lease)
    assert parse_lease(text) == lease
    timer = described("slicebox-ttl-sbx-1-1767225600.timer", text)
    assert timer is not None
    assert (timer.lease, timer.sandbox_id) == (lease, "sbx-1")
    root = Lease(task_id="t", root_task_id="t")
    assert parse_lease(description("sbx-1", root)) == root, "no parent reads back as none"
    assert parse_lease(description("sbx-1", None)) is None
    assert parse_lease("lease task=a b root=c parent=- depth=0 oneshot=0") is None
    assert parse_lease("lease task=$x root=c parent=- depth=0 oneshot=0") is None


def test_keys_differ_by_every_setting_that_decides_a_container() -> None:
    base = PoolKey(
        user="a",
        project="p",
        image="i",
        limits=Limits(cpus=0.5, memory_bytes=1 << 28, pids=100),
        network="none",
        run_as="65534:65534",
    )
    changes: list[dict[str, object]] = [
        {"user": "b"},
        {"project": "q"},
        {"image": "j"},
        {"limits": Limits(cpus=0.5, memory_bytes=1 << 29, pids=100)},
        {"network": "bridge"},
        {"run_as": "1000:1000"},
        {"cap_add": ("CHOWN",)},
        {"reuse": True},
    ]
    prints = {base.model_copy(update=change).fingerprint() for change in changes}
    assert len(prints | {base.fingerprint()}) == len(changes) + 1
    assert base.fingerprint() == PoolKey.model_validate(base.model_dump()).fingerprint()
