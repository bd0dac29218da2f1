"""``docs/configuration.md`` is generated from the config model (``slicebox.model.configdoc``):
every key of the file, in every table, with its type, default and what it does."""

from __future__ import annotations

import tomllib
from pathlib import Path

from slicebox.model.config import Config, parse_config
from slicebox.model.configdoc import Table, markdown, tables

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_docs_configuration_md_is_what_the_model_makes() -> None:
    assert DOC.read_text() == markdown(), (
        "docs/configuration.md is stale: run "
        "python3 -m slicebox.model.configdoc > docs/configuration.md"
    )


def by_header() -> dict[str, Table]:
    return {table.header: table for table in tables()}


def test_every_table_and_key_says_what_it_does() -> None:
    for table in tables():
        assert table.header == "" or table.description, f"{table.header} has no description"
        for key in table.keys:
            assert key.description, f"{table.header or 'top level'} {key.name}: no description"


def test_every_key_of_the_model_is_documented_once() -> None:
    """Walked by hand here: each nested model's fields are the keys of one table."""
    found = by_header()
    assert {key.name for key in found[""].keys} | {
        header.strip("[]").split(".")[0] for header in found if header
    } == set(Config.model_fields)
    assert [key.name for key in found["[reaper]"].keys] == [
        "interval_seconds",
        "orphans",
        "pool_size",
        "empty_slice_grace_seconds",
        "state_dir",
    ]
    assert {"[users.NAME]", '[projects."user/project"]', "[[pool]]", "[[egress.rule]]"} <= set(
        found
    )


def test_the_documented_defaults_are_the_defaults_the_agent_uses() -> None:
    """Each table's documented defaults, written as a file, load into the default config."""
    found = by_header()
    lines = []
    for header in ("", "[managed]", "[user]", "[project]", "[sandbox]", "[reaper]", "[shares]"):
        if header:
            lines.append(header)
        for key in found[header].keys:
            if key.default != "unset":
                lines.append(f"{key.name} = {key.default}")
    written = "\n".join(lines)
    tomllib.loads(written)  # the documented values are valid TOML
    assert parse_config(written) == Config()


def test_a_required_key_of_an_optional_table_says_so() -> None:
    daytona = {key.name: key for key in by_header()["[daytona]"].keys}
    assert daytona["api_url"].default == "required"
    assert daytona["target"].default == "unset"
