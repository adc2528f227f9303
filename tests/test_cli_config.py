"""A config a user can discover: `meshlearn config`, the resolved TOML, and docs/config.md."""

import tomllib
from pathlib import Path

from meshlearn.config import load_config, to_dict, valid_keys
from meshlearn.entry.cli import main
from meshlearn.train.config_help import DOCS_PAGE, config_markdown, describe_keys

ROOT = Path(__file__).parents[1]


def test_config_lists_every_key_with_type_default_and_description(capsys):
    assert main(["config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [k.key for k in describe_keys()]
    assert sorted(k.key for k in describe_keys()) == sorted(valid_keys())
    lr = next(line for line in lines if line.startswith("train.lr "))
    assert lr.split()[1:3] == ["float", "0.003"] and "Peak learning rate" in lr


def test_config_for_one_section_and_an_unknown_one(capsys):
    assert main(["config", "mesh"]) == 0
    assert all(line.startswith("mesh.") for line in capsys.readouterr().out.splitlines())
    assert main(["config", "meshh"]) == 2
    assert "sections: model, mesh" in capsys.readouterr().err


def test_config_resolved_prints_toml_that_loads_back(capsys, tmp_path):
    assert main(["config", "--resolved", str(ROOT / "configs" / "demo.toml"), "--set",
                 "train.lr=1e-3"]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "resolved.toml"
    path.write_text(text)
    assert tomllib.loads(text)["train"]["lr"] == 1e-3
    assert to_dict(load_config(path)) == to_dict(load_config(ROOT / "configs" / "demo.toml",
                                                             ["train.lr=1e-3"]))


def test_the_docs_page_lists_every_key_and_is_not_stale():
    page = (ROOT / DOCS_PAGE).read_text()
    assert page == config_markdown(), ("docs/config.md is stale: regenerate it with "
                                       "`python -m meshlearn.train.config_help`")
    for key in valid_keys():
        assert f"| `{key}` |" in page
