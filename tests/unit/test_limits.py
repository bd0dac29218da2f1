from __future__ import annotations

import pytest

from slicebox.model.errors import InvalidLimit
from slicebox.model.limits import (
    INFINITY,
    Ceiling,
    ceiling_properties,
    human_bytes,
    nano_cpus,
    parse_cpus,
    parse_pids,
    parse_size,
    plain_number,
)

MiB = 1024 * 1024


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (1234, 1234),
        ("256MB", 256 * MiB),
        ("256m", 256 * MiB),
        ("1GB", 1024 * MiB),
        ("1.5GiB", 1536 * MiB),
        ("512 KiB", 512 * 1024),
        ("100", 100),
        ("2T", 2 * 1024 * 1024 * MiB),
    ],
)
def test_sizes(raw: int | str, expected: int) -> None:
    assert parse_size("memory", raw) == expected


def test_percent_needs_a_total() -> None:
    assert parse_size("memory", "75%", total=4000) == 3000
    with pytest.raises(InvalidLimit, match="memory"):
        parse_size("memory", "75%")


@pytest.mark.parametrize("raw", [0, -1, "0MB", "lots", "", "1XB", "-5MB", "1e9", True])
def test_bad_sizes_name_the_field(raw: int | str) -> None:
    with pytest.raises(InvalidLimit, match=r"^invalid_limit: memory: "):
        parse_size("memory", raw)


def test_a_size_of_more_digits_than_a_float_holds_is_refused_not_a_crash() -> None:
    for raw, total in (("9" * 400, None), ("9" * 400 + "MB", None), ("9" * 400 + "%", 4000)):
        with pytest.raises(InvalidLimit, match="too large a size"):
            parse_size("memory", raw, total)


@pytest.mark.parametrize("raw", [0, -0.5, "lots", "nan", "inf", False])
def test_bad_cpus(raw: float | str) -> None:
    with pytest.raises(InvalidLimit, match="cpus"):
        parse_cpus("cpus", raw)


@pytest.mark.parametrize("raw", [0, -5, 1.5, "many", True])
def test_bad_pids(raw: float | str) -> None:
    with pytest.raises(InvalidLimit, match="pids"):
        parse_pids("pids", raw)


def test_good_numbers() -> None:
    assert parse_cpus("cpus", "0.5") == 0.5
    assert parse_pids("pids", "100") == 100
    assert nano_cpus(0.5) == 500_000_000


@pytest.mark.parametrize(
    ("ceiling", "expected"),
    [
        (
            Ceiling(memory_bytes=400 * MiB, memory_high_bytes=300 * MiB, cpus=1.5, pids=40),
            [
                ("MemoryMax", 400 * MiB),
                ("MemoryHigh", 300 * MiB),
                ("TasksMax", 40),
                ("CPUQuotaPerSecUSec", 1_500_000),
            ],
        ),
        (
            Ceiling(),
            [
                ("MemoryMax", INFINITY),
                ("MemoryHigh", INFINITY),
                ("TasksMax", INFINITY),
                ("CPUQuotaPerSecUSec", INFINITY),
            ],
        ),
    ],
)
def test_ceiling_properties(ceiling: Ceiling, expected: list[tuple[str, int]]) -> None:
    assert ceiling_properties(ceiling) == expected


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (256 * 2**20, "256 MiB"),
        (3221230000, "3.0 GiB"),
        (3 * 2**30, "3 GiB"),
        (2**40 + 2**39, "1.5 TiB"),
    ],
)
def test_human_bytes(nbytes: int, text: str) -> None:
    assert human_bytes(nbytes) == text


@pytest.mark.parametrize(
    ("value", "text"), [(0.5, "0.5"), (2.0, "2"), (0.125, "0.125"), (1e-5, "0.00001"), (3, "3")]
)
def test_plain_number(value: float, text: str) -> None:
    assert plain_number(value) == text
