"""The command line, as a user runs it: JSON out, one-line errors; a subprocess where vLLM's engines start."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import plain_env

pytestmark = pytest.mark.e2e  # the command line end to end


def run(*args, stdin=None, env=None, plain=False):
    """`plain`: as in a user's shell, without the variables the test session sets (`conftest.plain_env`)."""
    base = plain_env() if plain else dict(os.environ)
    full_env = {**base, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "specprefill", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=600,
    )


def main(*args, stdin=None, env=None):
    """`specprefill ARGS` through `cli.main` in this process (parsing, the errors a user can cause, the transformers
    engine), with the process's environment, stdin, stdout and stderr as a subprocess would have them. vLLM's engine
    starts, whose errors cross a process boundary, run in a subprocess (`run`)."""
    import contextlib
    import io

    from specprefill import cli

    out, err, saved, saved_stdin = io.StringIO(), io.StringIO(), dict(os.environ), sys.stdin
    os.environ.update(env or {})
    sys.stdin = io.StringIO(stdin or "")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as exc:  # argparse: --help, --version, usage errors
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
        sys.stdin = saved_stdin
    return subprocess.CompletedProcess(["specprefill", *args], code, out.getvalue(), err.getvalue())


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def prompt_file(tmp_path, prompts):
    path = tmp_path / "prompt.txt"
    path.write_text(prompts[2])
    return str(path)


def test_models_json(smollm2):
    out = json.loads(run("models", "--json").stdout)
    names = {m["name"]: m for m in out["models"]}
    assert set(names) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert names["smollm2-135m"]["materialized"] and names["smollm2-135m"]["path"] == smollm2


def test_importance_and_generate_json_match_engine(smollm2, prompt_file):
    from specprefill.config import SELECTION_RULES, SERVING_RULE, SpecPrefillConfig
    from specprefill.engines.hf import HFEngine

    args = [
        "--speculator",
        "smollm2-135m",
        "--prompt-file",
        prompt_file,
        "--keep-rate",
        "0.2",
        "--chunk-size",
        "8",
        "--look-ahead",
        "3",
        "--dtype",
        "float32",
        "--json",
    ]
    imp = main("importance", "--engine", "hf", *args)
    assert imp.returncode == 0, imp.stderr
    imp = json.loads(imp.stdout)
    gen = main("generate", "--engine", "hf", *args, "--base", "smollm2-135m", "--max-tokens", "5")
    assert gen.returncode == 0, gen.stderr
    gen = json.loads(gen.stdout)

    serving = SELECTION_RULES[SERVING_RULE]  # the CLI's default selection
    engine = HFEngine(
        smollm2, smollm2, SpecPrefillConfig(keep_rate=0.2, chunk_size=8, look_ahead=3, **serving), torch.float32
    )
    ids = engine.tokenizer(open(prompt_file).read())["input_ids"]
    ref = engine.generate([ids], max_tokens=5)[0]
    assert imp["prompt_token_ids"] == ids and imp["n_prompt_tokens"] == len(ids)
    assert len(imp["importance"]) == len(ids)
    assert imp["kept_indices"] == ref.kept_indices == gen["kept_indices"]
    assert gen["output_token_ids"] == ref.output_token_ids
    assert gen["output_text"] == ref.output_text
    assert set(gen["timings"]) >= {"speculation_s", "base_prefill_s", "ttft_s", "total_s"}
    assert imp["config"]["keep_rate"] == 0.2 and imp["config"]["selection_unit"] == serving["selection_unit"]


def test_chat_flag_applies_template(smollm2, prompt_file):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    text = open(prompt_file).read()
    proc = main(
        "importance",
        "--engine",
        "hf",
        "--speculator",
        "smollm2-135m",
        "--prompt-file",
        "-",
        "--chat",
        "--look-ahead",
        "1",
        "--json",
        stdin=text,
    )
    assert proc.returncode == 0, proc.stderr
    want = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert json.loads(proc.stdout)["prompt_token_ids"] == list(want)


def test_human_readable_output(smollm2, prompt_file):
    proc = main(
        "generate",
        "--engine",
        "hf",
        "--speculator",
        "smollm2-135m",
        "--base",
        "smollm2-135m",
        "--prompt-file",
        prompt_file,
        "--max-tokens",
        "3",
        "--look-ahead",
        "1",
    )
    assert proc.returncode == 0 and "kept:" in proc.stdout and "TTFT" in proc.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--keep-rate", "0"], "keep rate"),
        (["--keep-rate", "1.5"], "keep rate"),
        (["--chunk-size", "-1"], "chunk size"),
        (["--pool-kernel", "4"], "pool kernel"),
    ],
)
def test_bad_knobs(args, needle, prompt_file):
    assert_one_line_error(
        main("importance", "--speculator", "smollm2-135m", "--prompt-file", prompt_file, *args), needle
    )


def test_empty_prompt(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    assert_one_line_error(
        main("importance", "--speculator", "smollm2-135m", "--prompt-file", str(tmp_path / "empty.txt")), "empty"
    )


def test_prompt_file_not_utf8(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert_one_line_error(
        main("importance", "--speculator", "smollm2-135m", "--prompt-file", str(tmp_path / "latin1.txt")),
        "not UTF-8",
        "iconv",
    )


def test_model_that_is_not_there_is_one_line_error(tmp_path, prompt_file):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(
        main("importance", "--speculator", str(empty), "--prompt-file", prompt_file),
        "holds no model",
        "config.json",
        "weights",
        "tokenizer",
    )
    (empty / "config.json").write_text("{}")
    (empty / "tokenizer.json").write_text("{}")
    assert_one_line_error(
        main("importance", "--speculator", str(empty), "--prompt-file", prompt_file),
        "missing weights (*.safetensors or *.bin)",
    )
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert_one_line_error(main("importance", "--speculator", str(gguf), "--prompt-file", prompt_file), "gguf_file=")


def test_missing_prompt_file():
    assert_one_line_error(
        main("importance", "--speculator", "smollm2-135m", "--prompt-file", "/nonexistent/p.txt"), "prompt file"
    )


def test_unknown_model_name(prompt_file):
    assert_one_line_error(
        main("importance", "--speculator", "no such model!", "--prompt-file", prompt_file),
        "unknown model",
        "smollm2-135m",
    )


def test_unreachable_hub_id(prompt_file, tmp_path):
    """A subprocess: the hub client reads HF_HUB_OFFLINE and HF_ENDPOINT once, at import."""
    proc = run(
        "importance",
        "--speculator",
        "someorg/not-a-model",
        "--prompt-file",
        prompt_file,
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)},
    )
    assert_one_line_error(proc, "someorg/not-a-model", "not in the local Hugging Face cache", "HF_HUB_OFFLINE")
    # without the offline flag, a hub that does not answer is found out within seconds, not after a minute of retries
    proc = run(
        "importance",
        "--speculator",
        "someorg/not-a-model",
        "--prompt-file",
        prompt_file,
        env={"HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert_one_line_error(proc, "someorg/not-a-model", "could not be reached")


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_cross_tokenizer_generate(smollm2, tiny_tp_model, tmp_path, engine):
    """A speculator with another tokenizer: the prompt is in base tokens, so are the kept indices, and the answer is
    decoded by the base's tokenizer."""
    from specprefill.engines.common import load_tokenizer

    (tmp_path / "words.txt").write_text(" ".join(f"w{(i * 7) % 60}" for i in range(300)))
    proc = main(
        "generate",
        "--engine",
        engine,
        "--speculator",
        "smollm2-135m",
        "--base",
        tiny_tp_model,
        "--prompt-file",
        str(tmp_path / "words.txt"),
        "--keep-rate",
        "0.25",
        "--chunk-size",
        "8",
        "--max-tokens",
        "3",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    n = out["n_prompt_tokens"]
    assert n in (300, 301) and len(out["importance"]) == n  # the base's word-level tokens (+ its BOS)
    assert 0 < len(out["kept_indices"]) < n and max(out["kept_indices"]) < n
    assert out["output_text"] == load_tokenizer(tiny_tp_model).decode(out["output_token_ids"], skip_special_tokens=True)
    assert (
        out["prompt_token_ids"]
        == load_tokenizer(tiny_tp_model)(" ".join(f"w{(i * 7) % 60}" for i in range(300)))["input_ids"]
    )


def test_prompt_longer_than_context(tiny_model, tmp_path):
    (tmp_path / "long.txt").write_text(" ".join(f"w{i % 60}" for i in range(80)))
    proc = main(
        "generate", "--speculator", tiny_model, "--base", tiny_model, "--prompt-file", str(tmp_path / "long.txt")
    )
    assert_one_line_error(proc, "exceeds the 64-token context", "shorten the prompt")
    assert "Loading" not in proc.stderr


def test_missing_model_package_without_network(prompt_file, tmp_path):
    env = {k: "" for k in os.environ if k.startswith("PIP_")}
    env.update(
        {
            "SPECPREFILL_CACHE": str(tmp_path / "cache"),
            "PIP_CONFIG_FILE": os.devnull,
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": "",
        }
    )
    proc = main("importance", "--speculator", "smollm2-135m", "--prompt-file", prompt_file, env=env)
    assert_one_line_error(proc, "cannot download the packages", "smollm2-135m")
    assert not (tmp_path / "cache" / "models" / "smollm2-135m").exists()


@pytest.mark.heavy  # the CLI's vLLM path: test_cross_tokenizer_generate[vllm]; a plain shell: the plain-script tests
def test_vllm_engine_same_json_contract_as_hf(tmp_path, long_prompts):
    """vLLM runs as a user's plain shell runs it: vLLM's default multiprocess engines, no VLLM_*/OMP_* variables
    (the project sizes the two engines' memory and threads itself)."""
    path = tmp_path / "long.txt"
    path.write_text(long_prompts[1])
    args = [
        "--speculator",
        "smollm2-135m",
        "--prompt-file",
        str(path),
        "--keep-rate",
        "0.1",
        "--look-ahead",
        "4",
        "--dtype",
        "float32",
        "--json",
        "--base",
        "smollm2-135m",
        "--max-tokens",
        "6",
    ]
    hf = run("generate", "--engine", "hf", *args)
    vl = run("generate", "--engine", "vllm", *args, plain=True)
    assert hf.returncode == 0 and vl.returncode == 0, vl.stderr[-2000:]
    hf, vl = json.loads(hf.stdout), json.loads(vl.stdout)
    assert set(vl) == set(hf)
    for key in ("n_prompt_tokens", "prompt_token_ids", "kept_indices", "output_token_ids", "output_text", "dtype"):
        assert vl[key] == hf[key], key


def test_dtype_auto_is_recorded_and_html_heatmap(prompt_file, tmp_path):
    from specprefill import hardware

    page = tmp_path / "heat.html"
    proc = main(
        "importance",
        "--engine",
        "hf",
        "--speculator",
        "smollm2-135m",
        "--prompt-file",
        prompt_file,
        "--look-ahead",
        "1",
        "--json",
        "--html",
        str(page),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["dtype"] == hardware.auto_dtype() and result["html"] == str(page)
    html = page.read_text()
    assert html.startswith("<!doctype html>") and "<script" not in html
    kept = html.count('class="sp-tok sp-kept"')
    assert html.count('class="sp-tok"') + kept == result["n_prompt_tokens"]  # one span per prompt token
    assert kept == len(result["kept_indices"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heat.html", "prompt.txt"]  # no temp file left
    assert_one_line_error(
        main(
            "importance",
            "--speculator",
            "smollm2-135m",
            "--prompt-file",
            prompt_file,
            "--html",
            str(tmp_path / "no" / "such" / "dir.html"),
        ),
        "--html",
        "folder does not exist",
    )


def test_bad_engine_arg_is_one_line_error(prompt_file):
    proc = main(
        "generate",
        "--engine",
        "vllm",
        "--speculator",
        "smollm2-135m",
        "--base",
        "smollm2-135m",
        "--prompt-file",
        prompt_file,
        "--engine-arg",
        "max_num_seqs",
    )
    assert_one_line_error(proc, "--engine-arg 'max_num_seqs' is not KEY=VALUE")


def test_version_and_defaults_in_help():
    from importlib.metadata import version

    proc = main("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"specprefill {version('specprefill')}"
    text = main("generate", "--help").stdout
    for flag, default in (("--max-tokens", "64"), ("--engine", "vllm"), ("--look-ahead", "8"), ("--dtype", "auto")):
        after = text[text.index("\n  " + flag + " ") :]  # its line under options, not the usage line
        assert f"(default: {default})" in after[:300] or f"(default {default})" in after[:300], flag
    assert "--log-level" in main("--help").stdout
    served = main("serve", "--help")  # on standard output like every command's (`| less` shows it)
    assert "--speculator" in served.stdout and "`vllm serve` flags" in served.stdout
    assert "--speculator" not in served.stderr
    proc = main("--log-level", "LOUD", "models")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_every_help_prints_to_standard_output():
    """`specprefill [COMMAND [SUBCOMMAND]] --help | less` shows the help: every command's, generated from the parser."""
    import argparse

    from specprefill import cli

    def commands(parser, prefix=()):
        yield prefix
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from commands(sub, (*prefix, name))

    seen = list(commands(cli.parser()))
    assert len(seen) > 8 and ("bench", "ttft") in seen and ("serve",) in seen
    for command in seen:
        proc = main(*command, "--help")
        assert proc.returncode == 0 and proc.stdout.startswith("usage:") and proc.stderr == "", command


def test_what_vllm_raises_at_start_becomes_one_line(tmp_path, prompt_file):
    """A checkpoint vLLM cannot run (unknown architecture), as vLLM's own checks find it: one line naming the fix;
    with --log-level debug, vLLM's own trace above it."""
    sys.path.insert(0, os.path.dirname(__file__))
    from specprefill.models.tiny import save_tokenizer, tiny_checkpoint

    model = tiny_checkpoint(tmp_path / "m", "llama")
    save_tokenizer(model)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    args = ("generate", "--engine", "vllm", "--speculator", model, "--base", model, "--prompt-file", prompt_file)
    proc = main(*args, "--max-tokens", "2")
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "NoSuchModelForCausalLM" in lines[-1] and "choose a model" in lines[-1], lines[-1]
    debug = main("--log-level", "debug", *args, "--max-tokens", "2")
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "choose a model" in debug.stderr


def test_engine_arguments_vllm_refuses_become_one_line(smollm2, prompt_file, monkeypatch):
    """vLLM's own config check (SmolLM2's 9 heads cannot be split over 2 ranks): one line naming the setting, before
    either engine starts (`checks.check_config`)."""
    from specprefill.engines.vllm import builder

    def started(*args, **kwargs):
        raise AssertionError("an engine started before vLLM checked the base's arguments")

    monkeypatch.setattr(builder, "start_llm", started)
    proc = main(
        "generate", "--speculator", "smollm2-135m", "--base", "smollm2-135m", "--prompt-file", prompt_file,
        "--tensor-parallel-size", "2", "--max-tokens", "2",
    )  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]  # after the speculator's start-up warnings
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "vLLM refused the engine arguments" in last and "divisible by tensor parallel size" in last, last


def test_calibrate_shows_progress_through_both_scoring_steps(tiny_tp_model, tmp_path):
    """`specprefill calibrate` on vLLM's engines: standard error carries its progress bars through both scoring
    steps, the result goes to stdout. (That a plain shell sees no torch/vLLM/transformers warnings, vLLM's spawned
    engine and tensor-parallel worker processes included, is held by the plain-script test in test_vllm_engine.)"""
    import re

    args = ("calibrate", "--speculator", tiny_tp_model, "--base", tiny_tp_model, "--prompts", "1", "--length", "400")
    proc = main(*args, env={"SPECPREFILL_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    pieces = [p.strip() for p in re.split(r"[\r\n]+", proc.stderr) if p.strip()]
    assert any(p.startswith("calibrate: scoring the base") and "1/1" in p for p in pieces), pieces[-10:]
    assert any(p.startswith("calibrate: scoring every speculator head") and "1/1" in p for p in pieces)
    assert "cut after layer" in proc.stdout
