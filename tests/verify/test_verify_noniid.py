"""Non-identical data is normal (issue 31 item 4): a replica that trains on its own text is not
banned and little of it is quarantined, and an attacker elsewhere is still banned."""

from __future__ import annotations

import random

import pytest
from tiny import tiny_config

from meshlearn.train import Trainer

START = 12
# 4 stages × 4 replicas × 2 microbatches of 2 sequences (as tests/verify/test_verify_mesh.py).
VERIFY = ["mesh.stages=4", "mesh.replicas=4", "train.batch_size=16", "verify.name=sentinel",
          "verify.warmup_steps=10", "verify.window=32"]
# Other words than the shared tiny corpus's (conftest.py): replica 3's text shares no word with it.
OWN_WORDS = ["a", "ship", "sails", "over", "grey", "water", "under", "stars", "and", "men", "sing", "of",
             "home", "wind", "rope", "salt", "deck", "we", "row", "far", "cold", "north", "sea", "bread",
             "fish", "net", "storm"]


@pytest.fixture(scope="module")
def own_corpus(tmp_path_factory: pytest.TempPathFactory):
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("own") / "sea.txt"
    path.write_text("\n".join(" ".join(rng.choice(OWN_WORDS) for _ in range(rng.randint(4, 12)))
                              for _ in range(3000)))
    return path


def run(tiny_corpus, own_corpus, tmp_path, steps: int, *overrides: str) -> dict:
    cfg = tiny_config(tiny_corpus, *VERIFY, f"train.steps={steps}", f"data.replica_corpus=3:{own_corpus}",
                      *overrides)
    return Trainer(cfg, tmp_path, progress=False).train()


def test_an_honest_replica_on_its_own_text_is_neither_banned_nor_mostly_quarantined(
        tiny_corpus, own_corpus, tmp_path):
    summary = run(tiny_corpus, own_corpus, tmp_path, 30)
    trust = summary["trust"]
    assert summary["banned_workers"] == [] and trust["alerts"] == []
    assert trust["messages"]["all"]["fpr"] <= 0.05
    own = [v for w, v in trust["flags_per_worker"].items() if w.startswith("r3")]
    assert sum(v["flags"] for v in own) <= 0.05 * sum(v["scored"] for v in own)


@pytest.mark.parametrize("attack", [["attack.kind=scaling", "attack.scale=-1"], ["attack.kind=bias"]])
def test_an_attacker_beside_a_replica_on_its_own_text_is_still_banned(tiny_corpus, own_corpus, tmp_path,
                                                                      attack):
    summary = run(tiny_corpus, own_corpus, tmp_path, START + 8, "attack.workers=r1s1",
                  f"attack.start_step={START}", *attack)
    assert [(b["worker"], b["honest"]) for b in summary["banned_workers"]] == [("r1s1", False)]
    assert summary["banned_workers"][0]["step"] <= START + 3


@pytest.mark.xfail(strict=True, reason="open (issue 31 item 4): a replica whose text shares no byte "
                   "with the others' stands out from its peers from the first warm-up step and is "
                   "banned by the warm-up peer check, and without it by the fences (docs/sentinel.md, "
                   "'Non-identical data, measured')")
def test_an_honest_replica_on_text_of_other_bytes_is_not_banned(tiny_corpus, tmp_path):
    rng = random.Random(2)
    digits = tmp_path / "digits.txt"
    digits.write_text("\n".join(" ".join(str(rng.randint(0, 99999)) for _ in range(rng.randint(3, 9)))
                                for _ in range(3000)))
    assert run(tiny_corpus, digits, tmp_path / "run", 20)["banned_workers"] == []
