"""lm-evaluation-harness end to end, offline: the `specprefill` model on SmolLM2 with a small local task
(tests/lm_eval/needle_qa.yaml: `dataset_path: json`, local `data_files`), at keep rate 1.0 and 0.3, beside lm-eval's
own `vllm` model on the same task; `python -m specprefill.lm_eval` as a command."""

import json
import sys
from pathlib import Path

import pytest

from specprefill.settings import LmEvalSettings

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.e2e  # lm-eval runs, in this process or as a command
TASKS = Path(__file__).parent / "lm_eval"
ENGINE = "dtype=float32,max_model_len=2048,enforce_eager=True,enable_prefix_caching=False"


def evaluate(model, **kw) -> dict:
    """lm-eval's own entry (`simple_evaluate`) on the local task, in this process."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from specprefill.workbench import harness

    harness.index_stock_tasks_once()
    return lm_eval.simple_evaluate(
        model=model, tasks=["needle_qa"], task_manager=TaskManager(include_path=str(TASKS)), log_samples=True, **kw
    )


def test_specprefill_model_end_to_end(smollm2, monkeypatch):
    """The `specprefill` model as lm-eval builds it from --model_args (its registry, the argument string), at keep
    rate 1.0 and 0.3 on one pair, beside lm-eval's own `vllm` model (found through the `vllm` distribution record)."""
    from lm_eval.api.registry import get_model

    import specprefill.lm_eval  # noqa: F401  (registers "specprefill", as `python -m specprefill.lm_eval` does)

    monkeypatch.chdir(TASKS)  # the task's data_files are relative
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = f"pretrained=smollm2-135m,speculator=smollm2-135m,{ENGINE},keep_rate=1.0,kv_sequences=2"
    lm = get_model("specprefill").create_from_arg_string(args, {"batch_size": "auto"})
    assert lm.model.config.keep_rate == 1.0 and lm.model.params.max_model_len == 2048
    full = evaluate(lm)
    lm.model.config = lm.model.config.replace(keep_rate=0.3)
    pruned = evaluate(lm)
    lm.model.shutdown()
    plain = evaluate(
        "vllm", model_args=f"pretrained={smollm2},{ENGINE},kv_cache_memory_bytes=536870912", batch_size="auto"
    )
    for result in (full, pruned):
        assert set(result["results"]["needle_qa"]) >= {"exact_match,strip", "exact_match_stderr,strip"}
        assert result["results"]["needle_qa"]["sample_len"] == 6
    full_samples, pruned_samples, plain_samples = (r["samples"]["needle_qa"] for r in (full, pruned, plain))
    # keep rate 1.0 is plain prefill: the same answers and score as lm-eval's own vLLM model
    assert [s["resps"] for s in full_samples] == [s["resps"] for s in plain_samples]
    assert full["results"]["needle_qa"]["exact_match,strip"] == plain["results"]["needle_qa"]["exact_match,strip"]
    # 30% of each ~650-token context still holds the needle for most questions
    assert pruned["results"]["needle_qa"]["exact_match,strip"] >= 0.5
    assert [s["doc_id"] for s in pruned_samples] == [s["doc_id"] for s in full_samples]


def test_bad_model_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """lm-eval's command line with a base that is no model: one line, before lm-eval reads its task index."""
    from lm_eval.tasks import TaskManager

    from specprefill import lm_eval as spl

    def index(*args, **kwargs):
        raise AssertionError("the task index was read before the model was checked")

    monkeypatch.setattr(TaskManager, "__init__", index)
    monkeypatch.chdir(TASKS)
    for model_args, message in (
        (f"pretrained={tmp_path},speculator=smollm2-135m", f"{tmp_path} holds no model"),
        ("speculator=smollm2-135m", "needs pretrained=BASE,speculator=SPECULATOR"),
    ):
        argv = ["specprefill.lm_eval", "--model", "specprefill", "--model_args", model_args]
        monkeypatch.setattr(sys, "argv", [*argv, "--include_path", ".", "--tasks", "needle_qa"])
        with pytest.raises(SystemExit) as exc:
            spl.main()
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith("specprefill.lm_eval: error: ") and message in err, err


def notebook_pair(engine_pool):
    """The pair a notebook builds from its engine parameters (`SpecPrefillLLM.from_params`), shared."""
    from specprefill.config import EngineParams, SpecPrefillConfig
    from specprefill.engines.vllm.pair import SpecPrefillLLM

    params = EngineParams("smollm2-135m", base="smollm2-135m", dtype="float32", max_model_len=2048, kv_sequences=2)
    return engine_pool.get(
        ("notebook pair", repr(params)), lambda: SpecPrefillLLM.from_params(params, SpecPrefillConfig())
    )


def test_notebook_quality_runs_lm_eval_tasks_on_the_built_pair(tmp_path, smollm2, monkeypatch, engine_pool):
    """What notebooks 01-03 do with `lm_eval_tasks` (the paper profiles): lm-eval on the pair they built, one
    resumable unit per variant, rows that feed the same summary (n, intervals, paired difference to full)."""
    import lm_eval as harness

    from specprefill.workbench import quality, stats
    from specprefill.workbench import records as rec

    monkeypatch.chdir(TASKS)  # the task's data_files are relative
    llm = notebook_pair(engine_pool)

    def run():
        return quality.quality(
            llm,
            rec.long_context_records("lm_eval", None, 0, 0, []),
            rec.variants([0.3]),
            tmp_path,
            8,
            lm_eval=LmEvalSettings(lm_eval_tasks=["needle_qa"], lm_eval_limit=4, lm_eval_include_path=str(TASKS)),
        )

    rows = run()
    assert len(rows) == 8 and {(r["label"], r["keep_rate"]) for r in rows} == {("full", 1.0), ("specprefill", 0.3)}
    assert {r["metric"] for r in rows} == {"exact_match"} and {r["index"] for r in rows} == {0, 1, 2, 3}
    summary = stats.summarize(rows).set_index("label")
    assert summary.loc["specprefill", "n_paired"] == 4 and "diff_vs_full" in summary

    def must_not_run(**_):
        raise AssertionError("a finished lm-eval unit was computed again")

    monkeypatch.setattr(harness, "simple_evaluate", must_not_run)
    assert run() == rows  # resumed from the unit files


def test_rows_from_lm_eval_samples():
    from specprefill.errors import SpecPrefillError
    from specprefill.workbench.quality import lm_eval_rows

    # RULER: metrics named by length, -1 for the lengths a document is not; its row takes the document's length
    ruler = [
        {
            "doc_id": i,
            "doc": {"max_length": 4096},
            "filter": "none",
            "4096": 1.0 - i,
            "8192": -1.0,
            "filtered_resps": ["x"],
        }
        for i in range(2)
    ]
    rows = lm_eval_rows("niah_single_1", ruler, [{"metric": "4096"}, {"metric": "8192"}])
    assert [(r["index"], r["score"], r["metric"]) for r in rows] == [(0, 100.0, "4096"), (1, 0.0, "4096")]
    # two filters (e.g. gsm8k's strict and flexible): one row per document, from the first
    two = [
        {"doc_id": 0, "doc": {}, "filter": f, "exact_match": v, "filtered_resps": ["1"]}
        for f, v in (("strict-match", 1.0), ("flexible-extract", 0.0))
    ]
    assert [r["score"] for r in lm_eval_rows("gsm8k", two, [{"metric": "exact_match"}])] == [100.0]
    # a protocol naming the filter it scores (GPQA's flexible extraction): that filter's rows
    flexible = lm_eval_rows("gpqa", two, [{"metric": "exact_match"}], filter="flexible-extract")
    assert [(r["score"], r["filter"]) for r in flexible] == [(0.0, "flexible-extract")]
    with pytest.raises(SpecPrefillError, match="has no filter 'loose': use one of strict-match, flexible-extract"):
        lm_eval_rows("gpqa", two, [{"metric": "exact_match"}], filter="loose")
    with pytest.raises(SpecPrefillError, match="not one number per sample"):
        lm_eval_rows(
            "ifeval",
            [{"doc_id": 0, "doc": {}, "inst_level_strict_acc": [True, False], "filtered_resps": ["x"]}],
            [{"metric": "inst_level_strict_acc"}],
        )


PAPER_MINI_DATA = Path(__file__).parent / "data" / "paper-mini"


def test_lm_eval_longbench_from_a_data_dir_with_the_originals_templates(tmp_path, smollm2, engine_pool, monkeypatch):
    """lm-eval's own LongBench task definitions reading rows from a directory in LongBench's schema, each task
    through the chat template or not as the original ran it, a configuration family as the pruned variant, and a
    baseline (notebook 07 on LongBench): the base receives exactly the baseline's kept tokens of the prompts lm-eval
    rendered, at the variant's keep rate."""
    from specprefill import selectors
    from specprefill.config import SpecPrefillConfig
    from specprefill.workbench import quality
    from specprefill.workbench import records as rec

    settings = LmEvalSettings(
        ["longbench_hotpotqa", "longbench_trec_e"], lm_eval_limit=2, chat_template=True, data_dir=str(PAPER_MINI_DATA)
    )
    pair = notebook_pair(engine_pool)
    seen = []
    real = pair.generate_kept

    def spy(prompt_ids, kept, *args, **kwargs):
        seen.append((prompt_ids, kept, pair.config.keep_rate))
        return real(prompt_ids, kept, *args, **kwargs)

    monkeypatch.setattr(pair, "generate_kept", spy)
    import lm_eval

    evaluations = []
    evaluate = lm_eval.simple_evaluate

    def counted(**kwargs):
        evaluations.append(kwargs["tasks"])
        return evaluate(**kwargs)

    monkeypatch.setattr(lm_eval, "simple_evaluate", counted)
    variants = rec.variants([0.5], families=["p_full"]) + rec.variants([0.3], methods=("rag_bm25",), full=False)
    rows = quality.lm_eval_quality(pair, variants, tmp_path, SpecPrefillConfig(), settings)
    got = {(r["task"], r["label"], r["chat_template"]) for r in rows}
    assert got == {
        ("longbench_hotpotqa", "full", True),
        ("longbench_hotpotqa", "p_full", True),
        ("longbench_hotpotqa", "rag_bm25", True),
        ("longbench_trec_e", "full", False),  # LongBench's prediction script leaves trec untemplated
        ("longbench_trec_e", "p_full", False),
        ("longbench_trec_e", "rag_bm25", False),
    }
    assert len(rows) == 12 and all(0 <= r["score"] <= 100 for r in rows)
    assert {r["keep_rate"] for r in rows if r["label"] == "rag_bm25"} == {0.3}
    assert seen and {rate for _, _, rate in seen} == {0.3}  # only the baseline selects outside SpecPrefill's path
    config = SpecPrefillConfig(keep_rate=0.3)
    for prompts, kept, _ in seen:
        assert kept == selectors.Selection(pair, [list(p) for p in prompts]).kept("rag_bm25", config)
        assert all(len(k) <= -(-3 * len(p) // 10) for p, k in zip(prompts, kept))
    assert sum(len(p) for batch, _, _ in seen for p in batch) > 4 * 150  # the four LongBench prompts, not fragments
    units = [json.loads(f.read_text()) for f in (tmp_path / "units" / "lm_eval").glob("*.json")]
    assert len(units) == 6  # one per variant and task: a sharded run spreads them over its jobs
    assert len(evaluations) == 3 * 2  # ... evaluated together: one run per variant and template group
    assert {tuple(u["key"]["spec"]["lm_eval_tasks"]) for u in units} == {(t,) for t in settings.lm_eval_tasks}
    for unit in units:  # every unit records the local data its task read, under its own task's name
        (task,) = unit["key"]["spec"]["lm_eval_tasks"]
        assert set(unit["key"]["spec"]["local_data"]) == {task}


def test_local_tasks_plan_groups_generated_rows_and_missing_data(tmp_path):
    """The paper profiles' lm-eval tasks read from a directory: a group (MMLU, categories defined inline) runs as a
    local group of all 57 subjects, RULER reads generated rows instead of generating them, and a task whose rows the
    directory lacks is a one-line error naming the file, never a silent read from the hub."""
    import yaml

    from specprefill.errors import SpecPrefillError
    from specprefill.workbench import harness

    tasks = ["mmlu_generative", "ruler_qa_hotpot", "niah_single_1", "gsm8k_cot_llama"]
    plan = harness.local_tasks(tasks, PAPER_MINI_DATA, tmp_path)
    assert plan.run == {t: harness.LOCAL_PREFIX + t for t in tasks} and set(plan.digests) == set(tasks)
    group = yaml.safe_load((tmp_path / "local_mmlu_generative.yaml").read_text())
    assert len(group["task"]) == 57 and group["aggregate_metric_list"][0]["metric"] == "exact_match"
    assert plan.task_of("local_mmlu_anatomy_generative") == "mmlu_generative" and plan.task_of("local_x") == "x"
    hotpot = (tmp_path / "local_ruler_qa_hotpot.yaml").read_text()
    assert "custom_dataset: null" in hotpot and str(PAPER_MINI_DATA / "ruler" / "qa_hotpot.jsonl") in hotpot
    partial = tmp_path / "partial"
    (partial / "mmlu").mkdir(parents=True)
    (partial / "mmlu" / "anatomy.jsonl").write_text((PAPER_MINI_DATA / "mmlu" / "anatomy.jsonl").read_text())
    with pytest.raises(SpecPrefillError, match=r"no rows for 56 task\(s\): mmlu_abstract_algebra_generative \(mmlu/"):
        harness.local_tasks(["mmlu_generative"], partial, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused: no definitions half-written
    with pytest.raises(SpecPrefillError, match="lm-eval has no task 'nope'"):
        harness.local_tasks(["nope"], None, tmp_path / "out")


def test_stock_task_index_read_once_then_include_paths_on_top(tmp_path):
    """lm-eval's own tasks indexed once per process; each TaskManager still reads its include paths afresh, and a task
    there overrides lm-eval's of the same name (as lm-eval merges paths)."""
    from lm_eval.tasks import TaskManager

    from specprefill.workbench import harness

    harness.index_stock_tasks_once()
    own = tmp_path / "tasks"
    own.mkdir()
    task = "task: {name}\ndataset_path: json\noutput_type: generate_until\ndoc_to_text: q\ndoc_to_target: a\n"
    (own / "mine.yaml").write_text(task.format(name="arc_easy"))
    first = TaskManager(include_path=str(own))
    assert first.task_index["arc_easy"].yaml_path == own / "mine.yaml"
    assert "gsm8k" in first.task_index and "mmlu" in first.all_groups
    (own / "mine.yaml").write_text(task.format(name="specprefill_mine"))
    second = TaskManager(include_path=str(own))
    assert "specprefill_mine" in second.task_index and second.task_index["arc_easy"].yaml_path != own / "mine.yaml"
    from lm_eval.tasks import _index

    own_build = _index.TaskIndex.build.lm_eval_build  # lm-eval's index, read without the cache
    expected = own_build([Path(_index.__file__).parent, own])
    assert set(expected) == set(second.task_index)
    assert all(expected[k] == second.task_index[k] for k in expected)  # the kept copy is lm-eval's index


def test_stock_task_index_is_kept_on_disk_for_the_installed_lm_eval(tmp_path, monkeypatch):
    """The index of lm-eval's own folder is read back from the cache folder by later processes; a damaged copy is
    built again and replaced; another installation (another folder) has a key of its own."""
    from lm_eval.tasks import _index

    from specprefill.workbench import harness

    monkeypatch.setenv("SPECPREFILL_CACHE", str(tmp_path))
    stock, calls = Path(_index.__file__).parent, []

    def build(paths):
        calls.append(paths)
        return {"task": len(calls)}

    assert harness._read_stock_index(build, stock) == {"task": 1} == harness._read_stock_index(build, stock)
    assert calls == [[stock]]
    (kept,) = (tmp_path / "lm_eval").glob("stock-index-*.pickle")
    kept.write_bytes(b"damaged")
    assert harness._read_stock_index(build, stock) == {"task": 2} == harness._read_stock_index(build, stock)
    assert harness._stock_index_key(tmp_path) not in (None, harness._stock_index_key(stock))


def test_run_groups_follow_the_per_task_protocol():
    """One lm-eval run per (template, few-shot, answer cap): MMLU untemplated with 4 answer tokens and GPQA 8-shot
    as the original scripts ran them; a profile's cap applies on top; bad task arguments are one-line errors."""
    from specprefill.errors import SpecPrefillError
    from specprefill.workbench import harness

    tasks = ["gsm8k_cot_llama", "mmlu_generative", "gpqa_main_generative_n_shot", "longbench_trec"]
    args = {
        "mmlu_generative": {"chat_template": False, "max_gen_toks": 4},
        "gpqa_main_generative_n_shot": {"num_fewshot": 8},
    }
    assert harness.run_groups(tasks, True, args) == {
        (True, None, None): ["gsm8k_cot_llama"],
        (False, None, 4): ["mmlu_generative"],
        (True, 8, None): ["gpqa_main_generative_n_shot"],
        (False, None, None): ["longbench_trec"],
    }
    assert harness.run_groups(tasks[:2], True, args, max_gen_toks=16) == {
        (True, None, 16): ["gsm8k_cot_llama"],
        (False, None, 4): ["mmlu_generative"],
    }
    with pytest.raises(SpecPrefillError, match="not one of lm_eval_tasks"):
        harness.check_task_args(tasks, {"mmlu": {"num_fewshot": 5}})
    with pytest.raises(SpecPrefillError, match="unknown fewshot; use chat_template, num_fewshot, max_gen_toks, filter"):
        harness.check_task_args(tasks, {"mmlu_generative": {"fewshot": 5}})


def test_ifeval_rows_needing_missing_nltk_data_are_a_one_line_error(tmp_path, monkeypatch):
    """IFEval scores sentence counts with nltk's punkt data: rows that use such an instruction, where the data is
    missing, fail before any generation with the command that installs it; rows that do not, run."""
    import nltk

    from specprefill.errors import SpecPrefillError
    from specprefill.workbench import harness

    def find(resource, *a, **k):
        raise LookupError(resource)

    monkeypatch.setattr(nltk.data, "find", find)
    harness.local_tasks(["leaderboard_ifeval"], PAPER_MINI_DATA, tmp_path / "ok")  # its rows need no nltk data
    data = tmp_path / "data" / "instruction-following-eval"
    data.mkdir(parents=True)
    row = {"key": 1, "prompt": "Write 3 sentences.", "kwargs": [{"num_sentences": 3, "relation": "at least"}]}
    row["instruction_id_list"] = ["length_constraints:number_sentences"]
    (data / "default.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(SpecPrefillError, match=r"number_sentences .* run `python -m nltk.downloader punkt_tab`"):
        harness.local_tasks(["leaderboard_ifeval"], tmp_path / "data", tmp_path / "out")


def test_lm_eval_truncation_is_checked_before_anything_runs(tmp_path):
    from specprefill.config import SpecPrefillConfig
    from specprefill.errors import SpecPrefillError
    from specprefill.workbench import quality

    with pytest.raises(SpecPrefillError, match="lm_eval_truncation 'top': use left, middle or right"):
        settings = LmEvalSettings(["longbench_trec"], lm_eval_truncation="top")
        quality.lm_eval_quality(None, [], tmp_path, SpecPrefillConfig(), settings)


def test_evalplus_tasks_score_programs_in_the_sandbox(tmp_path, monkeypatch):
    """EvalPlus's HumanEval+ and MBPP+ as the project's lm-eval tasks (found without naming their folder), rows from
    a directory in the hub's schema, EvalPlus's chat prompt; each answer's program runs with the row's own tests in
    the sandbox: a right answer scores 100 whatever it prints, a wrong one or one that exits early 0."""
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    from specprefill.data import sandbox
    from specprefill.workbench import harness, quality

    if sandbox.bwrap_problem():
        monkeypatch.setenv(sandbox.WEAK_ENV, "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    right = "def running_max(numbers):\n    out = []\n    for n in numbers:\n"
    right += "        out.append(max(out[-1:] + [n]))\n    return out\n"
    answers = {
        "running_max": right + "print(running_max([1, 2]))\n```\nThis keeps the maximum so far.",
        "mean_square": "def mean_square(xs):\n    return sum(xs) / len(xs)\nimport os\nos._exit(0)\n",
    }

    class Canned(LM):
        prompts: list[str] = []

        def generate_until(self, requests):
            self.prompts += [r.args[0] for r in requests]
            return [answers["running_max" if "running_max" in r.args[0] or "largest" in r.args[0] else "mean_square"]
                    for r in requests]  # fmt: skip

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    tasks = ["evalplus_humaneval", "evalplus_mbpp"]
    plan = harness.local_tasks(tasks, PAPER_MINI_DATA, tmp_path / "local")
    lm = Canned()
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=[plan.run[t] for t in tasks],
        task_manager=TaskManager(include_path=harness.include_paths(tmp_path / "local")),
        log_samples=True,
    )
    for task in tasks:
        reported = plan.run[task]
        rows = quality.lm_eval_rows(reported, out["samples"][reported], out["configs"][reported]["metric_list"])
        assert [(r["index"], r["score"], r["metric"]) for r in rows] == [(0, 100.0, "pass_at_1"), (1, 0.0, "pass_at_1")]
        assert "print(" not in rows[0]["prediction"] and "```" not in rows[0]["prediction"]
    assert all(p.startswith("Please provide a self-contained Python script") for p in lm.prompts)
    assert all(p.endswith("passes corresponding tests:\n```python\n") for p in lm.prompts)
    assert '"""\nWrite a function that returns the largest value' in "".join(lm.prompts)  # MBPP+: docstring + assert


def test_original_scoring_variants_prompt_and_score_as_the_originals_patched_tasks(tmp_path):
    """GSM8K, MMLU and ARC as the original repository's patched tasks ran them (the project's *_original
    definitions), through lm-eval's own pipeline on local rows with a scripted model: GSM8K's strict answer pattern
    takes "The final answer is 12." but not "$12" (lm-eval's stock pattern takes both) after lm-eval's eight
    exemplars; MMLU counts an answer whose first letter is the right choice in either case; ARC keeps a question with
    three choices (the stock task drops it) and takes the first capital A-D of the answer."""
    import shutil

    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    from specprefill.workbench import harness

    data = tmp_path / "data"
    for folder in ("gsm8k", "mmlu", "ai2_arc"):
        shutil.copytree(PAPER_MINI_DATA / folder, data / folder)
    three = {"id": "three", "question": "Which is a gas?", "answerKey": "C"}
    three["choices"] = {"text": ["iron", "ice", "steam"], "label": ["A", "B", "C"]}
    with open(data / "ai2_arc" / "ARC-Challenge.jsonl", "a") as f:
        f.write(json.dumps(three) + "\n")
    tasks = ["gsm8k_cot_llama_original", "mmlu_generative_original", "arc_challenge_llama_original"]
    plan = harness.local_tasks(tasks, data, tmp_path / "defs")
    seen = {}

    class Scripted(LM):
        def generate_until(self, requests):
            out = []
            for r in requests:
                task, doc, context = r.task_name, r.doc, r.args[0]
                seen.setdefault(task, []).append(context)
                if "gsm8k" in task:
                    target = doc["answer"].split("####")[-1].strip()
                    out.append(f"So. The final answer is {target}." if r.doc_id % 2 == 0 else f"It is ${target}.")
                elif "mmlu" in task:
                    out.append(" " + "ABCD"[doc["answer"]].lower() + ") because" if r.doc_id % 2 == 0 else "The B")
                else:
                    out.append(f"reasoning: {doc['answerKey']}")
            return out

        def loglikelihood(self, requests):
            raise AssertionError("generative tasks only")

        loglikelihood_rolling = loglikelihood

    manager = TaskManager(include_path=harness.include_paths(tmp_path / "defs"))
    out = lm_eval.simple_evaluate(
        model=Scripted(), tasks=[plan.run[t] for t in tasks], task_manager=manager, log_samples=True
    )
    results, samples = out["results"], out["samples"]
    gsm8k = results[plan.run["gsm8k_cot_llama_original"]]
    n = gsm8k["sample_len"]
    assert gsm8k["exact_match,strict-match"] == pytest.approx(((n + 1) // 2) / n)
    assert gsm8k["exact_match,flexible-extract"] == 1.0
    first = next(c for t, c in seen.items() if "gsm8k" in t)[0]
    assert first.count("The final answer is") == 2 * 8 + 1  # each exemplar's instruction and answer, the question's
    assert "to the problem. \nProblem:" in first
    mmlu = [s for t, s in samples.items() if "mmlu" in t]
    assert len(mmlu) == 57
    hits = [x["exact_match"] for s in mmlu for x in s]
    assert sum(hits) == sum(1 for s in mmlu for x in s if x["doc_id"] % 2 == 0)
    arc = samples[plan.run["arc_challenge_llama_original"]]
    assert len(arc) == 4 and all(x["exact_match"] == 1.0 for x in arc)
    assert "3 candidate answers (A, B, C)" in seen[plan.run["arc_challenge_llama_original"]][-1]


def test_task_digests_cover_the_templates_tasks_include(tmp_path, monkeypatch):
    """Editing an included template (`_template_yaml`, a name lm-eval's index skips) changes the digest in the key
    of every unit that runs the project's tasks; the package's code version reads the same files
    (`store.is_definition`)."""
    import shutil

    from specprefill.workbench import harness, store

    template = harness.TASKS_DIR / "original" / "mmlu" / "_template_yaml"
    assert store.is_definition(template)
    copy = tmp_path / "tasks"
    shutil.copytree(harness.TASKS_DIR, copy)
    monkeypatch.setattr(harness, "TASKS_DIR", copy)
    before = harness.tasks_digest()
    edited = copy / "original" / "mmlu" / "_template_yaml"
    edited.write_text(edited.read_text() + "\n# edited\n")
    assert harness.tasks_digest() != before
