"""Self-speculation: a self:K speculator is the base's first K layers, built from the base's weights."""

import argparse
import json

import pytest
import torch

from specprefill import models
from specprefill.errors import SpecPrefillError


def test_truncated_base_scores_like_the_bases_first_layers(tiny_tp_model):
    from specprefill.engines.hf import capture_speculator, load_model

    path = models.resolve_speculator("self:2", tiny_tp_model)
    config = json.loads(open(f"{path}/config.json").read())
    assert config["num_hidden_layers"] == 2 and config[models.SELF_MARK]["of"] == 3 and models.is_self_speculator(path)
    with open(f"{path}/{models.INDEX}") as f:
        names = set(json.load(f)["weight_map"])
    assert not any(".layers.2." in n for n in names) and any(".layers.1." in n for n in names)
    assert models.param_count(path) < models.param_count(tiny_tp_model)
    ids = [1] + [3 + (i * 5) % 61 for i in range(200)]
    q_base, k_base, _ = capture_speculator(load_model(tiny_tp_model, torch.float32, capture=True), ids, 1, set())
    q_self, k_self, _ = capture_speculator(load_model(path, torch.float32, capture=True), ids, 1, set())
    assert q_self.shape[0] == 2 and q_base.shape[0] == 3
    assert torch.allclose(q_self, q_base[:2], atol=1e-5) and torch.allclose(k_self, k_base[:2], atol=1e-5)
    assert models.resolve_speculator("self:0.6", tiny_tp_model) == path  # round(0.6 * 3) = 2, built once
    assert models.resolve_speculator("self:0.1", tiny_tp_model).endswith("-1")  # at least one layer


def test_a_truncated_speculators_importance_is_the_full_models_restricted_to_its_layers(tiny_tp_model):
    """<model>:K is any model's first K layers: with look-ahead 1 (its default: no logits needed) its importance
    equals the whole model's scored over layers 0..K-1 only (`score_heads`), and a head set restricts it further."""
    from specprefill.config import SpecPrefillConfig
    from specprefill.engines.hf import HFEngine

    path = models.resolve_speculator(f"{tiny_tp_model}:2", None)  # no base needed: the model names itself
    assert json.loads(open(f"{path}/config.json").read())["num_hidden_layers"] == 2
    assert models.default_look_ahead(f"{tiny_tp_model}:2") == 1 == models.default_look_ahead("smollm2-135m:10")
    ids = [[1] + [3 + (i * 11) % 61 for i in range(300)]]
    full, cut = HFEngine(tiny_tp_model), HFEngine(path)
    for heads in ("all", "1.2,0.0"):
        config = SpecPrefillConfig(keep_rate=0.2, look_ahead=1, score_heads=heads)
        restricted = "layers:0-1" if heads == "all" else heads
        want = full.speculate(ids, [config.replace(score_heads=restricted)])[0]
        got = cut.speculate(ids, [config])[0]
        assert got.kept_indices == want.kept_indices
        assert torch.allclose(torch.tensor(got.importance), torch.tensor(want.importance), atol=1e-5)
    assert full.speculate(ids, [config.replace(score_heads="all")])[0].importance != want.importance
    with pytest.raises(SpecPrefillError, match="use fewer"):
        models.resolve_speculator(f"{tiny_tp_model}:3", None)
    with pytest.raises(SpecPrefillError, match="unknown model"):
        models.resolve_speculator("no-such-model:2", None)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("self:0", "write self:K"),
        ("self:abc", "write self:K"),
        ("self:1.5", "write self:K"),
        ("self:3", "has 3 layers"),
        ("self:-1", "write self:K"),
        ("self:junk:2", "write self:K"),
        ("self:0.5:3", "write self:K"),
    ],
)
def test_bad_self_speculators(tiny_tp_model, spec, match):
    with pytest.raises(SpecPrefillError, match=match):
        models.resolve_speculator(spec, tiny_tp_model)


def test_self_needs_a_base():
    with pytest.raises(SpecPrefillError, match="give a base"):
        models.resolve_speculator("self:2", None)
    assert models.resolve_speculator("self:2", "smollm2-135m", materialize_missing=False) == "self:2"


def test_look_ahead_defaults_to_one_for_self_only():
    from specprefill.cli.common import config as _config

    def ns(**kw):
        return argparse.Namespace(keep_rate=0.1, chunk_size=32, pool_kernel=13, restore_positions=True, **kw)

    assert _config(ns(look_ahead=None), "self:4").look_ahead == 1
    assert _config(ns(look_ahead=4), "self:4").look_ahead == 4  # explicit N > 1 is allowed
    assert _config(ns(look_ahead=None), "smollm2-135m").look_ahead == 8
