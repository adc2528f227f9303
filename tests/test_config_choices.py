"""Typed choices: a ``Literal`` field refuses any value but its choices, in one line, from a TOML file,
from ``--set`` and in a config built in code; ``meshlearn config`` and docs/config.md list them."""

import dataclasses
import typing

import pytest
import tomli_w

from meshlearn.compress.registry import WIRE_DTYPES, WireDtype
from meshlearn.config import RunConfig, choices_of, load_config, table_of, validate
from meshlearn.errors import ConfigError
from meshlearn.train.config_help import config_markdown, format_keys


def _literal_fields(cls: type = RunConfig, prefix: str = "") -> dict[str, tuple[tuple, object]]:
    """``{key: (choices, default)}`` of every ``Literal`` field of the config tree, tables included."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out |= _literal_fields(tp, f"{key}.")
        elif table_of(tp):
            out |= _literal_fields(table_of(tp), f"{key}.NAME.")
        elif choices_of(tp) is not None:
            out[key] = (choices_of(tp), f.default)
    return out


LITERALS = _literal_fields()
BAD = "not-a-choice"


def test_the_closed_choices_are_literal_fields():
    """The walk finds the converted fields (so the tests over LITERALS below cannot pass empty)."""
    assert {"backend", "mesh.schedule", "mesh.async_lr_rule", "links.access", "codec.wire_dtype",
            "codec.mask", "codec.backward.mask", "optim.muon_adjust_lr", "optim.numuon_rank_schedule",
            "optim.spectral.tau_mode", "sim.compute", "dist.comm", "dist.shaping", "dist.links",
            "dist.trusted_links", "warmup.placement", "warmup.order", "warmup.unlock_init",
            "protocol.morph"} <= set(LITERALS)
    assert LITERALS["mesh.schedule"][0] == ("1f1b", "async", "gpipe")


@pytest.mark.parametrize("key", sorted(LITERALS))
def test_every_literal_default_is_one_of_its_choices(key):
    choices, default = LITERALS[key]
    assert default in choices, f"{key} defaults to {default!r}, not one of {choices}"


def _message(key: str) -> str:
    return f"{key} = {BAD!r}: allowed: {list(LITERALS[key][0])}"


@pytest.mark.parametrize("key", sorted(LITERALS))
def test_set_refuses_a_value_outside_the_choices_in_one_line(key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={BAD}"])
    assert str(err.value) == _message(key)


@pytest.mark.parametrize("key", sorted(LITERALS))
def test_a_toml_file_refuses_a_value_outside_the_choices_in_one_line(tmp_path, key):
    tree: dict = {}
    *sections, leaf = key.split(".")
    node = tree
    for section in sections:
        node = node.setdefault(section, {})
    node[leaf] = BAD
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(tree))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == _message(key)


def test_a_choice_of_the_wrong_toml_type_is_refused_as_such(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[dist]\ntrusted_links = false\n")  # the choices are strings: "false"
    with pytest.raises(ConfigError, match=r"^dist\.trusted_links = False: expected a string$"):
        load_config(path)


def test_a_config_built_in_code_is_refused_by_validate():
    cfg = load_config(None)
    bad = dataclasses.replace(cfg, codec=dataclasses.replace(
        cfg.codec, backward=dataclasses.replace(cfg.codec.backward, mask="topk")))
    with pytest.raises(ConfigError) as err:
        validate(bad)
    assert str(err.value) == "codec.backward.mask = 'topk': allowed: ['fixed', 'bernoulli']"


def test_every_wire_dtype_choice_has_a_torch_dtype():
    assert set(WIRE_DTYPES) == set(typing.get_args(WireDtype))


def test_config_and_docs_show_the_choices_in_the_type_column():
    line = next(x for x in format_keys("mesh").splitlines() if x.startswith("mesh.schedule "))
    assert line.split()[1:6] == ["1f1b", "|", "async", "|", "gpipe"]
    assert '| `mesh.schedule` | 1f1b \\| async \\| gpipe | `"1f1b"` |' in config_markdown()
