"""Calibrated speculators: `specprefill calibrate` picks a cut and a head set for one (speculator, base) pair on
generated prompts, reproducibly; `calibrated:S` is that cut model carrying that head set."""

import json

import pytest
import torch

from specprefill import calibrate, models
from specprefill.config import SpecPrefillConfig
from specprefill.errors import SpecPrefillError
from specprefill.settings import CalibrationSettings


@pytest.fixture
def calibration_home(tmp_path, monkeypatch):
    monkeypatch.setattr("specprefill.models.calibration.cache_dir", lambda: tmp_path)
    return tmp_path


def test_answer_tokens_are_found_by_their_characters():
    text = "a 123 b 1234 c"
    offsets = [(0, 1), (2, 5), (6, 7), (8, 12), (13, 14)]
    assert calibrate.answer_mask(text, ["123"], offsets).tolist() == [False, True, False, True, False]
    assert not calibrate.answer_mask(text, ["999", ""], offsets).any()


def test_search_prefers_the_shortest_cut_within_tolerance():
    """Synthetic heads (2 layers x 2 heads, one prompt): only head 1.1 finds the needle, head 0.0 finds half of it;
    with tolerance 0.6 the one-layer cut wins, with 0 the two-layer one."""
    needle = torch.zeros(40, dtype=torch.bool)
    needle[30:34] = True
    prompt = calibrate.Prompt("t", list(range(40)), needle)
    rows = torch.rand(4, 40, generator=torch.Generator().manual_seed(0)) * 0.1
    rows[3, 30:34] = 1.0  # head 1.1
    rows[0, 30:32] = 1.0  # head 0.0
    config = SpecPrefillConfig(keep_rate=0.1, chunk_size=0, look_ahead=1, pool_kernel=0)
    strict = calibrate.search([rows], [rows[3]], [prompt], 2, config, CalibrationSettings(tolerance=0.0))
    assert strict["score_heads"] == "1.1" and strict["chosen"]["layers"] == 2 and strict["chosen"]["recall"] == 1.0
    loose = calibrate.search([rows], [rows[3]], [prompt], 2, config, CalibrationSettings(tolerance=0.6))
    assert loose["score_heads"] == "0.0" and loose["chosen"]["layers"] == 1 and loose["chosen"]["recall"] == 0.5


def test_calibration_is_reproducible_and_makes_a_calibrated_speculator(tiny_tp_model, calibration_home):
    """Same seed, same choice (and the same saved file but for its run time); the calibrated speculator is the model
    cut after its last scored layer, carrying the head set, and scores as the whole model restricted to those heads."""
    from specprefill.engines.hf import HFEngine

    with pytest.raises(SpecPrefillError, match="run `specprefill calibrate --speculator"):
        models.resolve_speculator(f"calibrated:{tiny_tp_model}", tiny_tp_model)
    settings = CalibrationSettings(prompts=3, length=400, calibration_seed=3)
    first = calibrate.calibrate(tiny_tp_model, tiny_tp_model, settings, engine="hf")
    again = calibrate.calibrate(tiny_tp_model, tiny_tp_model, settings, engine="hf")
    assert {k: v for k, v in first.items() if k != "seconds"} == {k: v for k, v in again.items() if k != "seconds"}
    assert first["prompts"] == 3 and 1 <= first["layers"] <= 3 and first["score_heads"]
    saved = json.loads(models.calibration_path(tiny_tp_model, tiny_tp_model).read_text())
    assert saved["score_heads"] == first["score_heads"] and saved["settings"]["calibration_seed"] == 3
    assert "cut after layer" in calibrate.summary(first)

    path = models.resolve_speculator(f"calibrated:{tiny_tp_model}", tiny_tp_model)
    config_json = json.loads(open(f"{path}/config.json").read())
    assert config_json["num_hidden_layers"] == first["layers"]
    assert models.default_look_ahead(f"calibrated:{tiny_tp_model}") == 1
    ids = [[1] + [3 + (i * 13) % 61 for i in range(300)]]
    config = SpecPrefillConfig(keep_rate=0.2, look_ahead=1)
    got = HFEngine(path).speculate(ids, [config])[0]  # auto: the carried head set
    want = HFEngine(tiny_tp_model).speculate(ids, [config.replace(score_heads=first["score_heads"])])[0]
    assert got.kept_indices == want.kept_indices
    assert torch.allclose(torch.tensor(got.importance), torch.tensor(want.importance), atol=1e-5)
    assert calibrate.ensure(tiny_tp_model, tiny_tp_model) is None  # not a calibrated speculator


def test_a_derived_speculator_can_be_calibrated(tiny_tp_model, calibration_home, capsys):
    """calibrate --speculator self:2 saves under the derived model; calibrated:self:2 finds it. Both scoring steps
    show their progress on standard error (done/total)."""
    first = calibrate.calibrate("self:2", tiny_tp_model, CalibrationSettings(prompts=1, length=400), engine="hf")
    err = capsys.readouterr().err
    assert "calibrate: scoring the base" in err and "calibrate: scoring every speculator head" in err
    assert err.count("1/1") >= 2
    path = models.resolve_speculator("calibrated:self:2", tiny_tp_model)
    assert json.loads(open(f"{path}/config.json").read())["num_hidden_layers"] == first["layers"] <= 2


def test_bad_calibration_settings_are_one_line_errors():
    for bad in ({"prompts": 0}, {"length": 10}, {"keep_rate": 1.0}, {"tolerance": -1}, {"max_heads": 0}):
        with pytest.raises(SpecPrefillError) as err:
            CalibrationSettings(**bad)
        assert "\n" not in str(err.value)
