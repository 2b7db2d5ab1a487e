"""Interfaces generated from the fields of SpecPrefillConfig and EngineParams: CLI flags of generate, importance,
bench and serve, a server's command line, lm-eval's model arguments and the notebooks' parameters cells. No weights
are loaded and no engine starts."""

import argparse
import dataclasses

import pytest

from specprefill import cli, flags
from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.errors import SpecPrefillError

COMMANDS = (["generate"], ["importance"], ["bench", "ttft"], ["bench", "qps"], ["serve"])


def _subparser(parser: argparse.ArgumentParser, path: list[str]) -> argparse.ArgumentParser:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions}


def _extended():
    """Copies of both dataclasses with one more field each."""

    @dataclasses.dataclass
    class Knobs(SpecPrefillConfig):
        new_knob: int = dataclasses.field(default=3, metadata={"help": "a new knob", "stage": "score"})

    @dataclasses.dataclass
    class Params(EngineParams):
        new_param: float | None = dataclasses.field(
            default=None, metadata={"help": "a new engine argument", "role": "base"}
        )

    return Knobs, Params


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_field_is_a_flag_of_every_command(command):
    dests = _dests(_subparser(cli.parser(), command))
    names = {f.name for cls in (SpecPrefillConfig, EngineParams) for f in dataclasses.fields(cls)}
    assert names <= dests, sorted(names - dests)


def test_a_new_field_appears_in_every_interface(monkeypatch):
    Knobs, Params = _extended()
    monkeypatch.setattr(cli.common, "SpecPrefillConfig", Knobs)
    monkeypatch.setattr(cli.common, "EngineParams", Params)
    parser = cli.parser()
    for command in COMMANDS:
        assert {"new_knob", "new_param"} <= _dests(_subparser(parser, command)), command
    args = parser.parse_args(
        ["generate", "--speculator", "s", "--base", "b", "--prompt-file", "p", "--new-knob", "5", "--new-param", "0.5"]
    )
    assert cli.common.config(args).new_knob == 5 and cli.common.engine_params(args).new_param == 0.5
    # a server's command line (the QPS comparison) round-trips it
    params, knobs = Params(speculator="s", base="b", new_param=0.25), Knobs(new_knob=7)
    argv = flags.to_argv(params) + flags.to_argv(knobs)
    back = parser.parse_args(["serve", *argv])
    assert cli.common.engine_params(back) == params and cli.common.config(back) == knobs
    # lm-eval's model arguments
    lm_eval = pytest.importorskip("specprefill.lm_eval")
    got_knobs, got_params, lm_args = lm_eval.split_model_args(
        {"pretrained": "b", "speculator": "s", "new_knob": 1, "new_param": 2.0, "max_gen_toks": 9, "quantization": "x"},
        Knobs,
        Params,
    )
    assert got_knobs == {"new_knob": 1} and lm_args == {"max_gen_toks": 9}
    assert got_params == {"base": "b", "speculator": "s", "new_param": 2.0, "engine_args": {"quantization": "x"}}
    # the notebooks' parameters cells
    from specprefill.workbench import parameters

    source = parameters.parameters_source('profile = "x"\nkeep_rate = 0.3\nreps = 2\n', (Knobs, Params))
    assert "new_knob = 3  # a new knob" in source and "new_param = None  # a new engine argument" in source
    assert "keep_rate = 0.3" in source and source.startswith('profile = "x"\n') and source.endswith("reps = 2\n")


def test_every_field_is_a_model_arg_of_the_lm_eval_model():
    lm_eval = pytest.importorskip("specprefill.lm_eval")
    kwargs = {f.name: flags.default_of(f) for cls in (SpecPrefillConfig, EngineParams) for f in dataclasses.fields(cls)}
    kwargs["pretrained"] = kwargs.pop("base")
    knobs, params, lm_args = lm_eval.split_model_args(kwargs)
    assert set(knobs) == {f.name for f in dataclasses.fields(SpecPrefillConfig)} and not lm_args
    assert set(params) == set(EngineParams.names())
    import inspect

    assert set(lm_eval.LM_ARGS) <= set(inspect.signature(lm_eval.VLLM.__init__).parameters)


def test_unsupported_lm_eval_model_args_are_refused():
    lm_eval = pytest.importorskip("specprefill.lm_eval")
    with pytest.raises(SpecPrefillError, match="does not support lora_local_path"):
        lm_eval.split_model_args({"pretrained": "b", "speculator": "s", "lora_local_path": "/x"})


def test_round_trip_of_every_field_through_argv():
    params = EngineParams(
        speculator="s",
        base="b",
        dtype="float32",
        max_model_len=1024,
        seed=3,
        tensor_parallel_size=2,
        speculator_tensor_parallel_size=2,
        gpu_memory_utilization=0.5,
        speculator_gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=2**30,
        speculator_kv_cache_memory_bytes=2**29,
        kv_sequences=2,
        enforce_eager=False,
        enable_prefix_caching=True,
        max_num_seqs=3,
        max_num_batched_tokens=512,
        max_speculation_tokens=4096,
        min_prompt_tokens=7,
        min_new_tokens=99,
        background_prefill="off",
        background_tokens_per_tenant=8192,
        speculation_queue=5,
        speculation_timeout_s=30.0,
        engine_args={"quantization": "fp8", "override_generation_config": {"a": [1, 2]}},
        speculator_engine_args={"tokenizer_mode": "slow"},
    )
    assert {f.name for f in dataclasses.fields(params) if getattr(params, f.name) != flags.default_of(f)} == set(
        EngineParams.names()
    ), "set every field to a non-default value"
    knobs = SpecPrefillConfig(
        keep_rate=0.3,
        chunk_size=16,
        look_ahead=2,
        pool_kernel=0,
        layer_head_agg="mean",
        step_agg="max",
        restore_positions=False,
        selection_unit="records",
        protect=True,
        query_weight=0.5,
        cross_token_agg="mean",
    )
    args = cli.parser().parse_args(["serve", *flags.to_argv(params), *flags.to_argv(knobs)])
    assert cli.common.engine_params(args) == params and cli.common.config(args) == knobs


def test_key_values_and_bad_items():
    assert flags.key_values(["max-num-seqs=8", "x={a: 1}"], "--engine-arg") == {"max_num_seqs": 8, "x": {"a": 1}}
    with pytest.raises(SpecPrefillError, match="not KEY=VALUE"):
        flags.key_values(["oops"], "--engine-arg")


def test_importance_refuses_base_engine_flags(tmp_path, capsys):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    assert (
        cli.main(["importance", "--speculator", "smollm2-135m", "--prompt-file", str(prompt), "--max-num-seqs", "2"])
        == 2
    )
    assert "--max-num-seqs set(s) the base engine" in capsys.readouterr().err
