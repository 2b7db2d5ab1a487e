"""Every decoder family's own attention rules, through the vLLM pair, against the transformers oracle; the
positions plugin's prefix-cache identity (tokens + positions); refused modes; per-request worker state that does not
grow.

Tiny random-weight checkpoints (`models.tiny`), built here: Llama, Qwen2, Qwen3 (q/k norm), Mistral (sliding
window), Gemma-2 (soft-cap, query scalar, alternating windows), Granite (attention multiplier), Phi-3 (fused
projections)."""

import asyncio
import random
from types import SimpleNamespace

import pytest
import torch

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.engines.vllm import capture, checks, positions
from specprefill.errors import SpecPrefillError
from specprefill.models.tiny import FAMILIES, tiny_checkpoint

CFG = SpecPrefillConfig(keep_rate=0.3, chunk_size=4, look_ahead=3, pool_kernel=3)
MAX_NEW = 6
LENGTHS = (150, 97, 201)


def greedy(n=MAX_NEW):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.fixture(scope="module")
def family_prompts():
    rng = random.Random(3)
    return [[1] + [rng.randrange(3, 64) for _ in range(n - 1)] for n in LENGTHS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: tiny_checkpoint(root / name, name, seed=i) for i, name in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def vllm_runs(checkpoints, family_prompts, engine_pool):
    """Per family: (kept, importance, greedy tokens) of each prompt through a vLLM pair (speculator = base)."""
    runs = {}
    for name, path in checkpoints.items():
        llm = engine_pool.pair(path, path, CFG, dtype="float32", max_model_len=256, kv_sequences=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in family_prompts], greedy())
        runs[name] = [
            (o.specprefill.kept_indices, torch.tensor(o.specprefill.importance), list(o.outputs[0].token_ids))
            for o in outs
        ]
    return runs


def oracle(path):
    from specprefill.engines.hf import HFEngine

    return HFEngine(path, path, CFG, torch.float32)


@pytest.mark.engine
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_the_oracle(family, checkpoints, vllm_runs, family_prompts):
    """Kept indices, importance and greedy tokens of the vLLM pair equal the transformers oracle's, whose rules
    come from the model's own attention call."""
    ref = oracle(checkpoints[family]).generate(family_prompts, max_tokens=MAX_NEW)
    for (kept, importance, tokens), r in zip(vllm_runs[family], ref):
        assert torch.allclose(importance, torch.tensor(r.importance), atol=1e-4), family
        assert kept == r.kept_indices, family
        assert tokens == r.output_token_ids, family


@pytest.mark.engine
@pytest.mark.parametrize("family,differs", [("granite", True), ("gemma2", True), ("llama", False)])
def test_forcing_one_over_sqrt_d_breaks_granite_and_gemma2(family, differs, checkpoints, vllm_runs, family_prompts):
    """The oracle's importance with every layer's scale forced to 1/sqrt(D) and no soft-cap (windows kept): the
    Granite and Gemma-2 cases no longer match what vLLM computed; Llama (whose scale is 1/sqrt(D)) still does."""
    from specprefill.engines.hf import capture_speculator

    engine = oracle(checkpoints[family])
    mismatched = []
    for ids, (_, importance, _) in zip(family_prompts, vllm_runs[family]):
        q, k, rules = capture_speculator(engine.speculator, ids, CFG.look_ahead, engine.eos_ids)
        forced = [core.AttentionRules(window=r.window) for r in rules]
        assert torch.allclose(core.token_importance(q, k, CFG, rules), importance, atol=1e-4)
        mismatched.append(not torch.allclose(core.token_importance(q, k, CFG, forced), importance, atol=1e-4))
    assert all(mismatched) if differs else not any(mismatched)


# ---------------------------------------------------------------- prefix cache


def caching_llm(engine_pool, path):
    """A plain `vllm.LLM` with prefix caching in blocks of 32 tokens (the positions plugin loaded, as everywhere)."""
    from specprefill.engines.vllm.builder import start_llm

    kwargs = {
        "dtype": "float32",
        "max_model_len": 512,
        "enable_prefix_caching": True,
        "block_size": 32,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 64 << 20,
    }
    return engine_pool.get(("prefix-caching llm", path), lambda: start_llm(path, kwargs))


@pytest.mark.engine
def test_position_maps_do_not_poison_the_prefix_cache(checkpoints, monkeypatch, engine_pool):
    """A plain `vllm.LLM` with prefix caching: a pruned prompt (position map) and then the same tokens without one
    (and the other way round) each get the oracle's tokens; with position keys disabled, the plain request reuses KV
    computed at the remapped positions and goes wrong."""
    from test_hf_engine import oracle_greedy
    from vllm import LLM

    from specprefill.engines.hf import load_model

    path = checkpoints["llama"]
    llm: LLM = caching_llm(engine_pool, path)
    model = load_model(path, torch.float32)
    rng = random.Random(9)

    def case():
        """A prompt whose pruned and plain answers differ, so that poisoning would show."""
        while True:
            got = draw()
            if got[2] != got[3][0]:
                return got

    def draw():
        n = 180
        kept = sorted(rng.sample(range(1, n), 96) + [0])  # 97 tokens: 3 full blocks, all reusable but the last token
        tokens = [1] + [rng.randrange(3, 64) for _ in range(n - 1)]
        ids = [tokens[i] for i in kept]
        pruned_params = greedy()
        pruned_params.extra_args = {positions.POSITIONS_KEY: {"kept": kept, "n": n}}
        want_pruned = oracle_greedy(model, ids, kept, n, MAX_NEW, set())
        want_plain = oracle_greedy(model, ids, list(range(len(ids))), len(ids), MAX_NEW, set())
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits
        plain_logprob = float(logits[0, -1].log_softmax(-1)[want_plain[0]])
        return ids, pruned_params, want_pruned, (want_plain, plain_logprob)

    def run(ids, params):
        params.logprobs = 0
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), next(iter(out.logprobs[0].values())).logprob

    def plain_matches(got, want, tolerance=1e-3):
        return got[0] == want[0] and abs(got[1] - want[1]) < tolerance

    ids, pruned_params, want_pruned, want_plain = case()
    assert run(ids, pruned_params)[0] == want_pruned
    assert plain_matches(run(ids, greedy()), want_plain)  # after the pruned request: not its KV
    ids, pruned_params, want_pruned, want_plain = case()
    assert plain_matches(run(ids, greedy()), want_plain)
    assert run(ids, pruned_params)[0] == want_pruned  # after the plain request: not its KV

    monkeypatch.setattr(positions, "position_key", lambda *args: None)
    ids, pruned_params, want_pruned, want_plain = case()
    assert run(ids, pruned_params)[0] == want_pruned
    assert not plain_matches(run(ids, greedy()), want_plain)  # what position keys prevent: KV at remapped positions


@pytest.mark.engine
def test_a_cached_block_is_reused_only_for_the_same_tokens_at_the_same_positions(checkpoints, engine_pool):
    """Pruned requests on a base with prefix caching (blocks of 32): a request hits exactly the leading blocks whose
    tokens and original positions both equal a cached request's — a position or a token changed in the third block
    stops the hits there, a kept run from position 0 shares its blocks with an unpruned prompt — and every answer is
    the oracle's."""
    from test_hf_engine import oracle_greedy

    from specprefill.engines.hf import load_model

    path = checkpoints["qwen2"]
    llm = caching_llm(engine_pool, path)
    model = load_model(path, torch.float32)
    rng = random.Random(21)
    n = 300
    tokens = [1] + [rng.randrange(3, 64) for _ in range(n - 1)]

    def run(kept, toks=tokens):
        params = greedy()
        ids = [toks[i] for i in kept]
        whole = kept == list(range(len(kept)))  # an ordinary prompt: no position map
        if not whole:
            params.extra_args = {positions.POSITIONS_KEY: {"kept": kept, "n": n}}
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        m = len(kept) if whole else n
        assert list(out.outputs[0].token_ids) == oracle_greedy(model, ids, kept, m, MAX_NEW, set())
        return out.num_cached_tokens

    kept = sorted(rng.sample(range(8, n - 1), 120))  # 4 blocks of 32 (3 full ones before the last token)
    assert run(kept) == 0
    assert run(kept) == 96  # the same request: every full block but the one holding the last token
    assert run(kept[:64] + [i + 1 for i in kept[64:]]) == 64  # positions differ from block 3 on
    other = list(tokens)
    other[kept[70]] = 2  # one token differs in block 3, positions the same
    assert run(kept, other) == 64
    shifted = [i + 1 for i in kept]  # every position differs: nothing in common
    assert run(shifted) == 0
    assert run(list(range(70))) == 0  # an unpruned prompt of the first 70 tokens, cached as positions 0..69
    assert run(list(range(64)) + [i for i in kept if i >= 64][:60]) == 64  # its two blocks from position 0


# ---------------------------------------------------------------- refused modes


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"data_parallel_size": 2}, "the speculator cannot run with data parallel"),
        ({"enable_dbo": True}, "the speculator cannot run with dual-batch overlap"),
        ({"ubatch_size": 2}, "the speculator cannot run with dual-batch overlap"),
        ({"speculative_config": {"method": "ngram"}}, "the speculator cannot run with speculative decoding"),
        ({"pipeline_parallel_size": 2}, "the speculator cannot run with pipeline parallel"),
        ({"prefill_context_parallel_size": 2}, "the speculator cannot run with prefill context parallel"),
        ({"enforce_eager": False}, "the speculator needs enforce_eager=True"),
    ],
)
def test_refused_speculator_modes(kwargs, message):
    with pytest.raises(SpecPrefillError, match=message) as err:
        checks.speculator_engine_kwargs(kwargs)
    assert "\n" not in str(err.value)


def test_refused_base_modes():
    with pytest.raises(SpecPrefillError, match="the base cannot run with speculative decoding") as err:
        checks.check_base_kwargs({"speculative_config": {"method": "eagle", "model": "x"}})
    assert "\n" not in str(err.value)
    with pytest.raises(SpecPrefillError, match="the base cannot run with prefill context parallel"):
        checks.check_base_kwargs({"prefill_context_parallel_size": 2})
    checks.check_base_kwargs({"enable_dbo": True, "tensor_parallel_size": 8})  # DBO slices rewritten positions


def _engine_config(uses_mrope=False, multimodal=False, speculative=None, pcp=1):
    model = SimpleNamespace(uses_mrope=uses_mrope, is_multimodal_model=multimodal, model="m")
    parallel = SimpleNamespace(
        pipeline_parallel_size=1,
        data_parallel_size=1,
        enable_dbo=False,
        ubatch_size=1,
        prefill_context_parallel_size=pcp,
    )
    return SimpleNamespace(model_config=model, parallel_config=parallel, speculative_config=speculative)


@pytest.mark.parametrize(
    "config,message",
    [
        (_engine_config(uses_mrope=True), "M-RoPE"),
        (_engine_config(multimodal=True), "multimodal"),
        (_engine_config(speculative=object()), "speculative decoding"),
    ],
)
def test_refused_base_models(config, message):
    """What a started base engine is checked for (`check_started`), and what the front end of any vLLM engine
    refuses position maps for (`unsupported_base`)."""
    assert message in positions.unsupported_base(config)
    with pytest.raises(SpecPrefillError, match=message) as err:
        checks.check_started("base", config, [None])
    assert "\n" not in str(err.value)
    checks.check_started("base", _engine_config(), [None])


def test_started_engines_with_prefill_context_parallel_are_refused():
    """PCP set by a flag or a default vLLM chose: found in the started engine's own config, for either engine."""
    for who in ("base", "speculator"):
        with pytest.raises(SpecPrefillError, match=f"the {who} cannot run with prefill context parallel"):
            checks.check_started(who, _engine_config(pcp=2), [None])


def test_refused_attention():
    alibi = SimpleNamespace(impl=SimpleNamespace(alibi_slopes=torch.ones(4)), has_sink=False)
    sink = SimpleNamespace(impl=SimpleNamespace(alibi_slopes=None), has_sink=True)
    plain = SimpleNamespace(impl=SimpleNamespace(alibi_slopes=None), has_sink=False)
    assert "ALiBi" in capture.attention_refusal([plain, alibi])
    assert "sink" in capture.attention_refusal([sink])
    assert capture.attention_refusal([plain]) is None
    reason = capture.attention_refusal([alibi])
    with pytest.raises(SpecPrefillError, match="speculator 'x' cannot be used: it uses ALiBi"):
        checks.check_installed([{"layers": 2, "refusal": reason}], "x", None)
    with pytest.raises(SpecPrefillError, match="the base model 'm' cannot be used: it uses ALiBi"):
        checks.check_started("base", _engine_config(), [None, reason])


@pytest.mark.engine
def test_front_end_refuses_position_maps_it_cannot_honour(checkpoints, monkeypatch, engine_pool):
    """The check runs in every vLLM front end (a plain `vllm.LLM` here), as that request's error."""
    from vllm.exceptions import VLLMValidationError

    from specprefill.engines.vllm.builder import start_llm

    kwargs = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True, "kv_cache_memory_bytes": 16 << 20}
    llm = engine_pool.get(("plain llm", checkpoints["qwen2"]), lambda: start_llm(checkpoints["qwen2"], kwargs))
    params = greedy(2)
    params.extra_args = {positions.POSITIONS_KEY: {"kept": [0, 5, 9], "n": 10}}
    assert llm.generate([{"prompt_token_ids": [1, 7, 9]}], params, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(positions, "unsupported_base", lambda config: "the model uses M-RoPE (test)")
    with pytest.raises(VLLMValidationError, match="the model uses M-RoPE"):
        llm.generate([{"prompt_token_ids": [1, 7, 9]}], params, use_tqdm=False)
    monkeypatch.undo()
    assert llm.generate([{"prompt_token_ids": [1, 7, 9]}], greedy(2), use_tqdm=False)[0].outputs[0].token_ids


# ---------------------------------------------------------------- worker state


@pytest.mark.engine
def test_worker_state_does_not_grow_over_100_requests(checkpoints):
    """100 pruned requests (and some run whole) through the async pair; the workers' per-request state (kept
    position maps, capture, V2 extra args) is read from the workers themselves after 25 and after 100: a leak of
    anything per request shows as a difference (and as a non-zero size after the last)."""
    from vllm import SamplingParams

    from specprefill.config import EngineParams
    from specprefill.engines.vllm import builder, planning
    from specprefill.engines.vllm.async_engine import KEEP_RATE_KEY, SpecPrefillEngineClient

    path = checkpoints["qwen3"]
    plan = planning.plan(EngineParams(path, base=path, dtype="float32", max_model_len=256, kv_sequences=8))

    async def scenario():
        base, speculator = await builder.start_async_pair(plan)
        client = SpecPrefillEngineClient(base, speculator, CFG)
        rng = random.Random(5)
        sizes = []

        async def one(i):
            ids = [1] + [rng.randrange(3, 64) for _ in range(rng.randrange(20, 120))]
            whole = {KEEP_RATE_KEY: 1.0}  # every 7th request runs whole
            params = SamplingParams(max_tokens=2, temperature=0.0, extra_args=None if i % 7 else whole)
            async for _ in client.generate({"prompt_token_ids": ids}, params, f"r{i}"):
                pass

        async def state():
            await one(-1)  # one more step: the workers hear of the last batch's finished requests
            spec = await speculator.llm.collective_rpc("specprefill_state_sizes")
            return spec, await base.collective_rpc("specprefill_state_sizes")

        try:
            for wave in range(0, 100, 25):
                await asyncio.gather(*[one(i) for i in range(wave, wave + 25)])
                if wave + 25 in (25, 100):
                    sizes.append(await state())
        finally:
            client.shutdown()
        return sizes, speculator.budget.total

    (after_25, after_100), budget = asyncio.run(scenario())
    assert after_25 == after_100
    zero = [{"kept": 0, "extra": 0, "capture": 0}]
    assert after_100 == (zero, zero), after_100
    assert budget > 256  # sized from free memory, at least one max_model_len prompt here


class _Trace:
    """(file under the package, qualified name) -> calls, of every package function entered in this process's threads
    while it is open."""

    def __init__(self) -> None:
        import collections
        import os

        import specprefill

        self.package = os.path.dirname(os.path.abspath(specprefill.__file__)) + os.sep
        self.calls: collections.Counter = collections.Counter()

    def _profile(self, frame, event, arg) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(self.package):
            self.calls[(name[len(self.package) :].replace("\\", "/"), frame.f_code.co_qualname)] += 1

    def __enter__(self):
        import sys
        import threading

        self._before = sys.getprofile(), threading.getprofile()
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        return self.calls

    def __exit__(self, *exc) -> None:
        import sys
        import threading

        sys.setprofile(self._before[0])
        threading.setprofile(self._before[1])


# one request's path: its plan and record, the speculator's preparation and request, the importance from the workers'
# scores, the one selection, the base's request
REQUEST_PATH = {
    ("engines/vllm/request.py", "plan"),
    ("engines/vllm/request.py", "Record.kept"),
    ("engines/vllm/speculation.py", "Speculator.checked"),
    ("engines/vllm/speculation.py", "Speculator.request"),
    ("engines/vllm/speculation.py", "Speculator.importance_of"),
    ("tokenmap.py", "Speculation.prune"),
    ("core/selection.py", "select"),
    ("engines/vllm/payloads.py", "base_request"),
}


@pytest.mark.engine
def test_the_library_and_the_server_run_a_request_through_the_same_functions(checkpoints, family_prompts, engine_pool):
    """One request through `SpecPrefillLLM.generate` and one through the server's engine client: the same functions in
    the same files on the request's path (`REQUEST_PATH`), the selection once in each, and the same kept set."""
    from vllm import SamplingParams

    from specprefill.config import EngineParams
    from specprefill.engines.vllm import builder, planning
    from specprefill.engines.vllm.async_engine import REQUEST_STATS, SpecPrefillEngineClient

    path, prompt = checkpoints["qwen3"], family_prompts[-1]
    llm = engine_pool.pair(path, path, CFG, dtype="float32", max_model_len=256, kv_sequences=2)
    with _Trace() as offline:
        out = llm.generate([{"prompt_token_ids": prompt}], greedy(1), use_tqdm=False)[0]
    plan = planning.plan(EngineParams(path, base=path, dtype="float32", max_model_len=256, kv_sequences=2))

    async def serve_one():
        base, speculator = await builder.start_async_pair(plan)
        client = SpecPrefillEngineClient(base, speculator, CFG)
        stats: list = []
        REQUEST_STATS.set(stats)
        try:
            with _Trace() as calls:
                async for _ in client.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), "t"):
                    pass
        finally:
            client.shutdown()
        return calls, stats

    served, stats = asyncio.run(serve_one())
    assert REQUEST_PATH <= set(offline) and REQUEST_PATH <= set(served)
    assert offline[("core/selection.py", "select")] == served[("core/selection.py", "select")] == 1
    assert not [k for k in served if k[0] == "engines/vllm/pair.py"]
    assert not [k for k in offline if k[0] == "engines/vllm/async_engine.py"]
    assert [r.kept_indices for r in stats] == [out.specprefill.kept_indices]
    assert stats[0].n_kept_tokens < len(prompt) and stats[0].speculator_prefilled_tokens == len(prompt)
    assert out.specprefill.speculator_prefilled_tokens == len(prompt)
