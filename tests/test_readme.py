"""The README as a newcomer meets it: the description and the two commands first, short, and every command line it
shows real — each `specprefill` line parses with the CLI's own parser (and `vllm serve`'s for serve's pass-through
flags) and its command answers `--help`, each `make` target, pip extra, constraint file and module exists, each
Python block compiles."""

import ast
import contextlib
import io
import re
import shlex
import sys
import tomllib
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
pytestmark = pytest.mark.e2e  # `--help` of every command the README shows, lm-eval's included, in this process


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def command_lines() -> list[list[str]]:
    """Every shell command of the README's bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    return out


def test_readme_opens_with_the_description_and_the_two_commands():
    before_code = README[: README.index("```")]
    assert "Speculative Prefill" in before_code and "original position" in before_code
    first = [argv[:2] for argv in command_lines()[:2]]
    assert first == [["make", "reproduce"], ["make", "test"]]
    assert len(README.splitlines()) <= 150  # the project's rule: current facts only


def test_python_blocks_compile():
    for block in blocks("python"):
        ast.parse(block)


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


def _check_specprefill(argv: list[str], helped: set[str]) -> None:
    from specprefill import cli

    try:
        args, rest = cli.parser().parse_known_args(argv[1:])
    except SystemExit:
        pytest.fail(f"README command does not parse: {shlex.join(argv)}")
    if args.command == "serve":
        from specprefill.serve.server import given_flags

        given_flags(rest)  # vLLM's parser: an unknown flag exits
    else:
        assert not rest, f"unknown flags {rest} in README command {shlex.join(argv)}"
    if args.command not in helped:
        helped.add(args.command)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            with pytest.raises(SystemExit) as done:  # in this process: `--help` answers, then exits 0
                cli.main([args.command, "--help"])
        assert done.value.code in (0, None), err.getvalue()[-2000:]


def _check_pip(argv: list[str]) -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for i, token in enumerate(argv):
        if token == "-c":
            assert (ROOT / argv[i + 1]).is_file(), argv[i + 1]
        if token == "-e":
            wanted = re.fullmatch(r"\.\[(.*)\]", argv[i + 1])
            assert wanted and set(wanted.group(1).split(",")) <= extras, argv[i + 1]


def _lm_eval_help() -> str:
    """`python -m specprefill.lm_eval run --help` (lm-eval's flags), in this process."""
    from unittest import mock

    from specprefill import lm_eval

    out = io.StringIO()
    with mock.patch.object(sys, "argv", ["specprefill.lm_eval", "run", "--help"]), contextlib.redirect_stdout(out):
        with contextlib.suppress(SystemExit):
            lm_eval.main()
    return out.getvalue()


def test_every_command_line_of_the_readme_exists():
    helped: set[str] = set()
    for argv in command_lines():
        if argv[0] == "specprefill":
            _check_specprefill(argv, helped)
        elif argv[0] == "make":
            targets = [t for t in argv[1:] if "=" not in t]
            assert set(targets) <= _make_targets(), f"no make target {targets} (README: {shlex.join(argv)})"
        elif argv[0] == "pip":
            _check_pip(argv)
        elif argv[:2] == ["python", "-m"] and argv[2] == "specprefill.lm_eval":
            text = _lm_eval_help()
            for flag in (t for t in argv[3:] if t.startswith("--")):
                assert flag in text, f"lm-eval has no {flag}"
        elif argv[:2] == ["python", "-m"]:
            assert find_spec(argv[2]) is not None, argv[2]
        elif argv[0] == "python3.11":
            assert argv[1:3] == ["-m", "venv"], argv
        elif argv[0] == "conda":
            assert (ROOT / argv[argv.index("-f") + 1]).is_file()
        else:
            assert argv[0] in ("cd", ".", "curl"), f"README shows a command this test does not know: {shlex.join(argv)}"
