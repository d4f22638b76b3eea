"""Held-out harness kinds: held_out_combo (seen module values, a combination training never
draws) and held_out_novel (`held_out`), checked on every domain's mix and through the
train sampler that episodes use (HarnessMix.sample, as the MOPD loop, seq-KD, the experts'
SFT and the eval draw it)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from core.agent.harness import harness_modules, load_harnesses, unseen_pairs
from core.config import ConfigError

REPO = Path(__file__).resolve().parents[3]
MIXES = sorted((REPO / "recipes" / "harnesses").glob("*.yaml"))


def _train_draws(mix, seeds=range(20), per_seed=100):
    """The module combinations of many episodes' harnesses, drawn as training draws them."""
    drawn = []
    for s in seeds:
        rng = random.Random(s)
        drawn += [mix.sample(rng) for _ in range(per_seed)]
    return drawn


def test_every_agent_domain_has_both_held_out_kinds():
    assert {p.stem for p in MIXES} >= {"agent", "coding_agent", "search_agent"}
    for p in MIXES:
        mix = load_harnesses(p)
        assert mix.held_out_combo and mix.held_out, p.name


@pytest.mark.parametrize("path", MIXES, ids=[p.stem for p in MIXES])
def test_held_out_combinations_are_never_drawn_in_training(path):
    mix = load_harnesses(path)
    drawn = _train_draws(mix)
    drawn_mods = [harness_modules(h) for h in drawn]
    assert {h.name for h in drawn} == {h.name for h in mix.harnesses}   # the sampler reaches every train harness
    held = {h.name for h in mix.held_out_combo + mix.held_out}
    assert not held & {h.name for h in drawn}
    for combo in mix.held_out_combo:
        mods = harness_modules(combo)
        assert mods not in drawn_mods, f"{path.name}: training drew {combo.name}'s combination"
        for k, v in mods.items():   # ...and yet each of its module values was trained on
            assert any(d[k] == v for d in drawn_mods), f"{path.name}: {combo.name}'s {k} never drawn in training"
        assert unseen_pairs(combo, drawn), f"{path.name}: every pair of {combo.name}'s modules was trained together"
    for novel in mix.held_out:   # held_out_novel: something training never saw at all
        mods = harness_modules(novel)
        assert any(all(d[k] != v for d in drawn_mods) for k, v in mods.items()), novel.name


def _mix(combo: dict) -> dict:
    return {"harnesses": [{"name": "a", "syntax": "json"},
                          {"name": "b", "syntax": "python", "system_prompt": "T\n{tools}\n{syntax}"}],
            "held_out_combo": [{"name": "c", **combo}]}


@pytest.mark.parametrize("combo, says", [
    ({"syntax": "xml"}, "its syntax appears in no train harness"),
    ({"syntax": "json", "context": {"kind": "last_k"}}, "its context appears in no train harness"),
    ({"syntax": "python", "system_prompt": "T\n{tools}\n{syntax}"}, "train harness 'b' has the same modules"),
])
def test_a_combo_that_is_not_a_new_combination_of_seen_modules_is_refused(combo, says):
    with pytest.raises(ConfigError, match=says):
        load_harnesses(_mix(combo))


def test_a_combo_whose_every_pair_was_trained_together_is_refused():
    # a, b, c below pair every syntax with every prompt and context; (python, P, last_k)
    # differs from each as a whole, but each of its pairs was trained
    mix = {"harnesses": [{"name": "a", "syntax": "json", "system_prompt": "P\n{tools}\n{syntax}",
                          "context": {"kind": "last_k"}},
                         {"name": "b", "syntax": "python", "system_prompt": "P\n{tools}\n{syntax}"},
                         {"name": "c", "syntax": "python", "context": {"kind": "last_k"}}],
           "held_out_combo": [{"name": "x", "syntax": "python", "system_prompt": "P\n{tools}\n{syntax}",
                               "context": {"kind": "last_k"}}]}
    with pytest.raises(ConfigError, match="every pair of its module values"):
        load_harnesses(mix)


def test_a_new_pairing_is_a_combo_and_by_name_finds_it():
    mix = load_harnesses(_mix({"syntax": "python"}))   # python with the default prompt: never together
    assert unseen_pairs(mix.held_out_combo[0], mix.harnesses) == [("syntax", "prompt")]
    assert mix.by_name("c") is mix.held_out_combo[0]
