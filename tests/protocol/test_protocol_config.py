"""The [protocol] section: its own keys, and one clear error line for each refused combination."""

import pytest

from meshlearn.config import load_config
from meshlearn.errors import ConfigError

MORPH = ["protocol.morph=orthogonal", "optim.name=muon"]


def test_default_is_off_and_keys_parse():
    cfg = load_config(None, [])
    assert cfg.protocol.morph == "off"
    cfg = load_config(None, ["protocol.morph=lowcond", "protocol.epsilon=0.1",
                             "protocol.every_steps=5", "optim.name=numuon"])
    assert (cfg.protocol.morph, cfg.protocol.epsilon, cfg.protocol.every_steps) == ("lowcond", 0.1, 5)


@pytest.mark.parametrize("overrides,key,hint", [
    (["protocol.morph=rotate"], "protocol.morph", "allowed: ['off', 'none', 'orthogonal', 'lowcond']"),
    (["protocol.every_steps=0"], "protocol.every_steps", "must be >= 1"),
    (["protocol.epsilon=0"], "protocol.epsilon", "in (0, 1]"),
    (["protocol.keep_snapshots=-1"], "protocol.keep_snapshots", "must be >= 0"),
    (["protocol.traffic_tokens=0"], "protocol.traffic_tokens", "must be >= 1"),
    (MORPH + ["codec.name=subspace", "model.subspace_rank=16"], "codec.name", "open detail 5"),
    (["protocol.morph=none", "codec.name=subspace", "model.subspace_rank=16"], "codec.name",
     "public basis U"),
    (["protocol.morph=none", "model.subspace_rank=16"], "model.subspace_rank", "dense"),
    (["protocol.morph=orthogonal"], "optim.name", "morphs need muon or numuon"),
    (["protocol.morph=lowcond", "optim.name=adamw"], "optim.name", "second moments"),
    (MORPH + ["backend=dist"], "protocol.keep_snapshots", "keeps no attack snapshots"),
    (MORPH + ["backend=dist", "protocol.keep_snapshots=0", "protocol.every_seconds=30"],
     "protocol.every_seconds", "virtual clock"),
    (MORPH + ["dp.name=sparse"], "dp.name", "slices of coordinates"),
    (MORPH + ["dp.name=diloco", "dp.compress=powersgd"], "dp.compress", "error feedback"),
    (["protocol.morph=none", "warmup.enabled=true"], "warmup.enabled", "warm-up"),
])
def test_refusals_name_the_key_in_one_line(overrides, key, hint):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key
    assert hint in str(err.value) and "\n" not in str(err.value)


def test_morphs_take_the_dp_strategies_and_plugins_whose_state_follows_them():
    for extra in (["dp.name=powersgd"], ["dp.name=diloco"], ["curvature.every=5"]):
        assert load_config(None, MORPH + extra).protocol.morph == "orthogonal"


def test_protocol_model_without_morphs_takes_any_optimizer():
    assert load_config(None, ["protocol.morph=none", "optim.name=adamw"]).protocol.morph == "none"
