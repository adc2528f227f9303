"""The one compatibility table (``meshlearn.compat``): every refused combination is a row with an
example that triggers it alone, its message is the one the scattered checks gave before the table
(tests/compat_messages.json, recorded from the code before the move), and its docs are fresh."""

import json
from pathlib import Path

import pytest

from meshlearn import compat
from meshlearn.config import load_config, read_config, valid_keys
from meshlearn.entry.cli import main
from meshlearn.errors import ConfigError
from meshlearn.train.compat_help import DOCS_PAGE, compat_markdown

ROOT = Path(__file__).parents[1]
BEFORE = json.loads((Path(__file__).parent / "compat_messages.json").read_text())


@pytest.mark.parametrize("row", compat.TABLE, ids=lambda row: " ".join(row.example))
def test_each_row_refuses_its_example_with_the_message_it_had_before_the_table(row):
    with pytest.raises(ConfigError) as err:
        load_config(None, list(row.example))
    assert str(err.value) == BEFORE[" ".join(row.example)]
    assert err.value.key == row.key
    # The message is this row's: every component's own checks passed and no earlier row refused.
    assert compat.first_refusal(read_config(None, list(row.example))) is row


def test_every_row_has_a_recorded_message_and_no_recording_is_orphaned():
    assert sorted(BEFORE) == sorted(" ".join(row.example) for row in compat.TABLE)


def test_the_defaults_and_the_demo_refuse_nothing():
    assert compat.first_refusal(read_config(None)) is None
    assert compat.first_refusal(read_config(ROOT / "configs" / "demo.toml")) is None


def test_every_row_names_a_config_key():
    keys = set(valid_keys())
    assert [row.key for row in compat.TABLE if row.key not in keys] == []


def test_config_compat_prints_every_row(capsys):
    assert main(["config", "--compat"]) == 0
    out = capsys.readouterr().out
    for i, row in enumerate(compat.TABLE, 1):
        assert f"{i:2d}. {row.settings}\n    refused as {row.key};" in out
    assert out.count("\n    → ") == len(compat.TABLE)


def test_the_docs_page_is_not_stale():
    assert (ROOT / DOCS_PAGE).read_text() == compat_markdown(), (
        "docs/compat.md is stale: regenerate it with `python -m meshlearn.train.config_help`")
