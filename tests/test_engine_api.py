"""Engine-free checks of the engines' public API: the `common.Engine` protocol and the default look-ahead of a
self-speculating pair."""

from types import SimpleNamespace

import pytest
import torch

from specprefill import models
from specprefill.config import SELF_LOOK_AHEAD, SpecPrefillConfig
from specprefill.engines.common import Engine
from specprefill.errors import SpecPrefillError
from specprefill.models import default_look_ahead

CFG = SpecPrefillConfig(keep_rate=0.5, chunk_size=4, look_ahead=2)


def test_hf_engine_follows_the_protocol(tiny_model):
    from specprefill.engines.hf import HFEngine

    engine = HFEngine(tiny_model, None, CFG, torch.float32)
    assert isinstance(engine, Engine)
    prompts = [[1] + [3 + i % 50 for i in range(n)] for n in (30, 17)]
    pruned = engine.speculate(prompts, [CFG, CFG.replace(keep_rate=1.0)])
    assert [p.n_original for p in pruned] == [31, 18] and len(pruned[1].kept_indices) == 18
    assert engine.last_timings["speculation_s"] > 0


def test_vllm_engine_follows_the_protocol():
    pytest.importorskip("vllm")
    from specprefill.engines.vllm.adapter import VLLMEngine

    calls = []

    def speculate(prompts, configs):
        calls.append((prompts, configs))
        return ["pruned"] * len(prompts)

    spec = SimpleNamespace(tokenizer="tok", speculate=speculate, last_timings={"speculator_s": 1.0})
    engine = VLLMEngine(CFG, speculator=spec)
    assert isinstance(engine, Engine)
    assert engine.speculate([[1, 2, 3]], [CFG]) == ["pruned"] and calls == [([[1, 2, 3]], [CFG])]
    assert engine.last_timings["speculator_s"] == 1.0 and engine.last_timings["speculation_s"] >= 0


def test_default_look_ahead_of_names_and_resolved_paths(tiny_tp_model):
    path = models.resolve_speculator("self:2", tiny_tp_model)
    assert default_look_ahead("self:2") == default_look_ahead(path) == SELF_LOOK_AHEAD
    for other in (tiny_tp_model, "smollm2-135m", None):
        assert default_look_ahead(other) == SpecPrefillConfig.look_ahead


@pytest.fixture
def pair_without_engines(monkeypatch):
    """`SpecPrefillLLM` with its plan, speculator and base `LLM` replaced by stand-ins: no engine starts."""
    pytest.importorskip("vllm")
    from specprefill.engines.vllm import builder, pair, planning

    class Stub:
        def __init__(self, *args, **kwargs):
            self.tokenizer = None
            self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=1024))

        def get_tokenizer(self):
            return None

    def start_pair(params):  # the plan as the builder makes it (names resolved), no engines
        return (
            planning.Plan(
                params,
                models.resolve(params.base),
                models.resolve_speculator(params.speculator, params.base),
                {"dtype": "float32"},
                {},
            ),
            Stub(),
            Stub(),
        )

    monkeypatch.setattr(builder, "start_pair", start_pair)
    return pair.SpecPrefillLLM


def test_self_speculating_pair_looks_ahead_one_token(pair_without_engines, tiny_tp_model):
    """Decided once the speculator is resolved: "self:K" and the path it resolves to alike."""
    path = models.resolve_speculator("self:2", tiny_tp_model)
    by_name = pair_without_engines(tiny_tp_model, "self:2")
    assert by_name.speculator_path == path and by_name.config.look_ahead == SELF_LOOK_AHEAD
    assert pair_without_engines(tiny_tp_model, path).config.look_ahead == SELF_LOOK_AHEAD
    assert pair_without_engines(tiny_tp_model, tiny_tp_model).config.look_ahead == SpecPrefillConfig.look_ahead
    assert pair_without_engines(tiny_tp_model, "self:2", CFG).config is CFG  # an explicit config is kept


def test_start_failures_a_user_can_fix_are_one_line(monkeypatch):
    from types import SimpleNamespace

    import psutil

    from specprefill.engines.common import require_chat_template, tokenize_prompt
    from specprefill.engines.vllm import sizing

    cases = [
        (ValueError("Model architectures ['FooForCausalLM'] are not supported for now. Supported: ..."), "Foo"),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "not enough memory"),
        (ValueError("No available memory for the cache blocks. Try increasing gpu_memory_utilization"), "memory"),
        (RuntimeError("Engine core initialization failed. See root cause above."), "failed to start"),
    ]
    for exc, needle in cases:
        with pytest.raises(SpecPrefillError, match=needle) as info, sizing.engine_errors("m"):
            raise exc
        assert "\n" not in str(info.value) and info.value.__cause__ is exc
    with pytest.raises(KeyError), sizing.engine_errors("m"):  # anything else passes through unchanged
        raise KeyError("x")
    tokenizer = SimpleNamespace(chat_template=None, name_or_path="base-model")
    with pytest.raises(SpecPrefillError, match="base-model has no chat template: send plain prompts"):
        tokenize_prompt(tokenizer, "hi", chat=True)
    require_chat_template(SimpleNamespace(chat_template="{{ messages }}"))
    # weights + KV caches that cannot fit in the memory free now: refused before any engine process starts
    monkeypatch.setattr(sizing, "is_cpu", lambda: True)
    monkeypatch.setattr(sizing, "model_shape", lambda path: sizing.ModelShape(2, 2, 64, 2048, 3 << 30, "bfloat16"))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=4 << 30))
    sizing.check_cpu_memory([("m", {"dtype": "bfloat16", "kv_cache_memory_bytes": 1 << 29})])  # 3.5 GiB: fits
    with pytest.raises(SpecPrefillError, match=r"need ~6.5 GiB .* 4.0 GiB are free: lower max_model_len"):
        sizing.check_cpu_memory([("m", {"dtype": "float32", "kv_cache_memory_bytes": 1 << 29})])


def test_a_pair_starts_together_only_where_that_is_safe_and_a_failed_start_stops_the_other(monkeypatch):
    """CPU, engine cores in processes of their own, one thread environment: both engines start at once (their vLLM
    imports overlap); one after the other otherwise. When one of the two fails, the one that started is stopped and
    the error is raised."""
    from specprefill.engines.vllm import builder, sizing

    monkeypatch.setattr(sizing, "is_cpu", lambda: True)
    assert builder.starts_together(1, 1, processes=True)
    assert not builder.starts_together(2, 1, processes=True)  # a core's process reads its threads when it starts
    assert not builder.starts_together(1, 1, processes=False)  # in-process cores start one after the other
    monkeypatch.setattr(sizing, "is_cpu", lambda: False)
    assert not builder.starts_together(1, 1, processes=True)  # GPUs: each engine measures the memory free at start

    stopped = []

    def fails():
        raise RuntimeError("no start")

    assert builder.both(lambda: "a", lambda: "b", stopped.append, stopped.append) == ("a", "b") and stopped == []
    with pytest.raises(RuntimeError, match="no start"):
        builder.both(lambda: "speculator", fails, stopped.append, stopped.append)
    with pytest.raises(RuntimeError, match="no start"):
        builder.both(fails, lambda: "base", stopped.append, stopped.append)
    with pytest.raises(RuntimeError, match="no start"):
        builder.both(fails, fails, stopped.append, stopped.append)
    assert stopped == ["speculator", "base"]


def test_a_prompt_past_the_speculators_window_is_refused_naming_speculators_that_fit(smollm2):
    """Past the speculator's own position limit, raising max_model_len cannot help: the one-line refusal names
    speculators whose window holds the prompt (no silent run of the whole prompt); within it, the old fix stands."""
    pytest.importorskip("vllm")
    from specprefill.engines.vllm.budgets import check_look_ahead, model_window
    from specprefill.models.registry import MODELS

    small = next(n for n, m in MODELS.items() if m.shape["max_position_embeddings"] == 8192)
    window = SimpleNamespace(max_model_len=8192, hf_text_config=SimpleNamespace(max_position_embeddings=8192))
    assert model_window(window) == 8192 and model_window(SimpleNamespace()) is None
    from vllm.config import ModelConfig

    assert model_window(ModelConfig(model=smollm2, max_model_len=2048)) == 8192  # vLLM's own rule, not max_model_len
    with pytest.raises(SpecPrefillError) as err:
        check_look_ahead(16_000, CFG, 8192, model_window(window))
    message = str(err.value)
    assert "\n" not in message and "8192 positions" in message and "16002 tokens" in message
    fits = [n for n, m in MODELS.items() if m.shape["max_position_embeddings"] >= 16_002]
    assert fits and all(n in message for n in fits) and f"{small}," not in message and "self:K" in message
    with pytest.raises(SpecPrefillError, match="raise max_model_len"):  # the model reads it: max_model_len is short
        check_look_ahead(5000, CFG, 4096, 8192)
    check_look_ahead(4094, CFG, 4096, 8192)  # fits: no error
