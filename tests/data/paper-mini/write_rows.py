"""Writes the paper-mini rows of every hub dataset but LongBench (whose rows are hand-written): RULER's generated rows,
GSM8K, ARC-Challenge, GPQA, IFEval, the 57 MMLU subjects and EvalPlus's HumanEval+/MBPP+, each in its hub dataset's
own schema, with text written for this project (filler prose, invented facts, simple questions). Deterministic:
`python tests/data/paper-mini/write_rows.py` rewrites the same files.
Lengths are counted with the SmolLM2 tokenizer (paper-mini's pair)."""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path

from specprefill.data import ruler

HERE = Path(__file__).parent
MAX_LENGTH = 2048  # RULER's length bucket of these rows (paper-mini's lm_eval_metadata)
WORDS = 350  # the haystack's size in words: prompts of ~500 tokens, inside the bucket with room to answer

PROSE = [
    "The harbour office opened at seven and the first ferry left when the fog had lifted.",
    "A committee of nine reviewed the library budget and asked for a second estimate.",
    "Most of the orchard was replanted after the winter storms took the older trees.",
    "The bridge over the canal was painted green, the colour the town had chosen decades ago.",
    "Every spring the school held a fair where students showed what they had built.",
    "The bakery on the corner sold out of rye bread before noon on market days.",
    "Engineers measured the river twice a week to see whether the new weir held.",
    "The museum kept its maps in a cool room because the paper was fragile.",
    "A small choir rehearsed in the old chapel on Thursday evenings.",
    "Cyclists used the lane by the railway, which was flat and sheltered from the wind.",
]
REPEAT = ruler.NOISE.strip()
NIAH = ruler.NIAH_TEMPLATE.replace("{type_needle_v}", "{v}")
ADJ = ["quiet", "amber", "brisk", "hollow", "silver", "gentle", "crooked", "rapid", "velvet", "lucky"]
NOUN = ["lantern", "harbor", "meadow", "pencil", "falcon", "teapot", "glacier", "ribbon", "candle", "compass"]


def _tokens(text: str) -> int:
    from transformers import AutoTokenizer

    from specprefill.models import model_dir

    global _TOKENIZER
    if "_TOKENIZER" not in globals():
        _TOKENIZER = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    return len(_TOKENIZER(text).input_ids)


def _key(rng, kind):
    return f"{rng.choice(ADJ)}-{rng.choice(NOUN)}" if kind == "words" else _uuid(rng)


def _value(rng, kind):
    return str(rng.randint(1000000, 9999999)) if kind == "numbers" else _uuid(rng)


def _uuid(rng):
    h = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _haystack(kind, rng, k_kind, v_kind):
    if kind == "noise":
        return [REPEAT] * (WORDS // 19)
    if kind == "needle":
        return [
            f"One of the special magic {v_kind} for {_key(rng, k_kind)} is: {_value(rng, v_kind)}." for _ in range(20)
        ]
    return [rng.choice(PROSE) for _ in range(WORDS // 14)]


NIAH_TASKS = ruler.TASKS  # task: (haystack, keys, values per key, keys asked, key kind, value kind), RULER's settings


def niah(task, index):
    rng = random.Random(f"{task}-{index}")
    hay, n_keys, n_values, n_asked, k_kind, v_kind = NIAH_TASKS[task]
    keys = []
    while len(keys) < n_keys:
        k = _key(rng, k_kind)
        keys += [k] if k not in keys else []
    values = [[_value(rng, v_kind) for _ in range(n_values)] for _ in keys]
    units = _haystack(hay, rng, k_kind, v_kind)
    for k, vs in zip(keys, values):
        for v in vs:
            units.insert(rng.randrange(len(units) + 1), f"One of the special magic {v_kind} for {k} is: {v}.")
    asked = keys[:n_asked]
    query = ", ".join(asked[:-1]) + (" and " if len(asked) > 1 else "") + asked[-1]
    one = n_asked * n_values == 1
    return {
        "input": NIAH.format(v=v_kind, context=" ".join(units), query=query),
        "outputs": [v for k, vs in zip(keys, values) if k in asked for v in vs],
        "gen_prefix": f"The special magic {v_kind[:-1] if one else v_kind} for {query} mentioned in the provided text "
        + ("is" if one else "are"),
    }


def vt(index):
    rng = random.Random(f"vt-{index}")
    value = str(rng.randint(10000, 99999))
    names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(5)]
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(4)]
    units = [REPEAT] * (WORDS // 19)
    spots = sorted(rng.sample(range(len(units)), len(chain)))
    for offset, (spot, statement) in enumerate(zip(spots, chain)):
        units.insert(spot + offset, statement + ".")
    return {
        "input": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        + " ".join(units)
        + f"\nQuestion: Find all variables that are assigned the value {value} in the text above.",
        "outputs": names,
        "gen_prefix": f"Answer: According to the chain(s) of variable assignment in the text above, 5 variables are "
        f"assigned the value {value}, they are:",
    }


def cwe(index):
    rng = random.Random(f"cwe-{index}")
    vocab = sorted({f"{a}{n}" for a in ADJ for n in NOUN})
    rng.shuffle(vocab)
    common, rare = vocab[:10], vocab[10:]
    words = common * 5 + rng.sample(rare, 30)
    rng.shuffle(words)
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    return {
        "input": "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        f"ones that appear most often.\n{listing}\nQuestion: What are the 10 most common words in the above list?",
        "outputs": common,
        "gen_prefix": "Answer: The top 10 words that appear most often in the list are:",
    }


def fwe(index):
    rng = random.Random(f"fwe-{index}")
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(200)]
    coded = rng.choices(vocab, weights=[1 / (i + 1) ** 2 for i in range(len(vocab))], k=150)
    top = sorted(set(coded), key=lambda w: (-coded.count(w), vocab.index(w)))[:3]
    return {
        "input": "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. " + " ".join(coded) + "\nQuestion: Do not provide any explanation. Please "
        "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",
        "outputs": top,
        "gen_prefix": "Answer: According to the coded text above, the three most frequently appeared words are:",
    }


PEOPLE = ["Ilse Varga", "Tomas Reyl", "Orla Quint", "Bram Holloway", "Sana Pirel", "Edda Morn"]
TOWNS = ["Kestrel Point", "Lowmere", "Astbury", "Fennick", "Carrow Vale", "Redholm"]


def qa(task, index):
    rng = random.Random(f"{task}-{index}")
    person, town, other = rng.sample(PEOPLE, 1)[0], *rng.sample(TOWNS, 2)
    year = rng.randint(1850, 1990)
    if task == "qa_squad":  # one document answers
        gold = [f"The lighthouse at {town} was designed by {person} and first lit in {year}."]
        question, answer = f"Who designed the lighthouse at {town}?", person
    else:  # hotpot: two documents, one hop each
        gold = [
            f"The lighthouse at {town} was designed by {person}.",
            f"{person} was born in {other}, a village known for its slate roofs.",
        ]
        question, answer = f"Where was the designer of the lighthouse at {town} born?", other
    docs = [" ".join(rng.choice(PROSE) for _ in range(3)) for _ in range(6)]
    for g in gold:
        docs.insert(rng.randrange(len(docs) + 1), g)
    body = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
    instruction = (
        "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    )
    return {
        "input": f"{instruction}\n\nThe following are given documents.\n\n{body}\n\n{instruction}\n\n"
        f"Question: {question}",
        "outputs": [answer],
        "gen_prefix": "Answer:",
    }


def ruler_rows(task: str, n: int = 2) -> list[dict]:
    rows = []
    for i in range(n):
        row = niah(task, i) if task in NIAH_TASKS else qa(task, i) if task.startswith("qa_") else globals()[task](i)
        rows.append(
            {"index": i, **row, "length": _tokens(row["input"] + " " + row["gen_prefix"]), "max_length": MAX_LENGTH}
        )
    return rows


def gsm8k_rows() -> list[dict]:
    rows = []
    for a, b, c in [(12, 7, 3), (40, 15, 5), (9, 6, 2)]:
        rows.append(
            {
                "question": f"A shelf holds {a} jars. Ida adds {b} jars and then takes away {c}. "
                "How many jars are on the shelf?",
                "answer": f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}.\n#### {a + b - c}",
            }
        )
    return rows


def arc_rows() -> list[dict]:
    items = [
        ("Which of these is needed for a plant to make its own food?", ["sand", "sunlight", "salt", "smoke"], "B"),
        (
            "What happens to water when it freezes?",
            ["It becomes a gas", "It becomes a solid", "It disappears", "It gets hotter"],
            "B",
        ),
        ("Which tool measures temperature?", ["ruler", "scale", "thermometer", "compass"], "C"),
    ]
    return [
        {"id": f"mini-arc-{i}", "question": q, "choices": {"text": c, "label": list("ABCD")}, "answerKey": k}
        for i, (q, c, k) in enumerate(items)
    ]


def gpqa_rows() -> list[dict]:
    rows = []
    for i in range(10):  # 8 few-shot examples + the questions they come before
        a, b = 3 + i, 4 + 2 * i
        rows.append(
            {
                "Question": f"A rectangle has sides {a} cm and {b} cm. What is its area in square centimetres?",
                "Correct Answer": str(a * b),
                "Incorrect Answer 1": str(a * b + 2),
                "Incorrect Answer 2": str(2 * (a + b)),
                "Incorrect Answer 3": str(a + b),
                "Explanation": f"Area is width times height: {a} x {b} = {a * b}.",
            }
        )
    return rows


def ifeval_rows() -> list[dict]:
    # instructions whose checks need no sentence tokenizer data (nltk's punkt_tab), so they score offline
    return [
        {
            "key": 1,
            "prompt": "Write a short note to a neighbour about a lost cat. Your entire response should be in English, "
            "and in all lowercase letters. No capital letters are allowed.",
            "instruction_id_list": ["change_case:english_lowercase"],
            "kwargs": [{}],
        },
        {
            "key": 2,
            "prompt": "List three reasons to visit a harbour town. Do not use any commas in your response.",
            "instruction_id_list": ["punctuation:no_comma"],
            "kwargs": [{}],
        },
    ]


def mmlu_subjects() -> list[str]:
    from lm_eval.tasks import TaskManager

    from specprefill.workbench.harness import leaves

    index = TaskManager().task_index
    return [t.removeprefix("mmlu_").removesuffix("_generative") for t in leaves("mmlu_generative", index)]


def mmlu_rows(subject: str, n: int, offset: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = 2 + i + offset, 3 + 2 * i
        right = a * b
        choices = [str(right), str(right + 1), str(a + b), str(right - 2)]
        order = random.Random(f"{subject}-{i}-{offset}").sample(range(4), 4)
        rows.append(
            {
                "question": f"({subject.replace('_', ' ')}) What is {a} times {b}?",
                "subject": subject,
                "choices": [choices[j] for j in order],
                "answer": order.index(0),
            }
        )
    return rows


# EvalPlus's hub rows carry one test program: the inputs, the reference outputs, and a comparison that allows a float
# tolerance (numpy). These problems and their programs are written for this project.
CHECK = """import numpy as np


def _is_float(x):
    return isinstance(x, float) or (isinstance(x, (list, tuple)) and bool(x) and all(isinstance(v, float) for v in x))


def _same(out, expected, atol):
    if atol == 0 and _is_float(expected):
        atol = 1e-6
    if out != expected and atol != 0:
        np.testing.assert_allclose(out, expected, rtol=1e-07, atol=atol)
    else:
        assert out == expected, (out, expected)
"""
CODE_PROBLEMS = [
    {
        "entry_point": "running_max",
        "prompt": "from typing import List\n\n\ndef running_max(numbers: List[int]) -> List[int]:\n"
        '    """The largest value seen so far at each position.\n'
        '    >>> running_max([1, 3, 2, 5])\n    [1, 3, 3, 5]\n    """\n',
        "solution": "    out = []\n    for n in numbers:\n"
        "        out.append(n if not out else max(out[-1], n))\n    return out\n",
        "inputs": [[[1, 3, 2, 5]], [[]], [[4, 4, 1]], [[-2, -5, 0, -1]], [list(range(50, 0, -1))]],
        "text": "Write a function that returns the largest value seen so far at each position of a list.",
    },
    {
        "entry_point": "mean_square",
        "prompt": "from typing import List\n\n\ndef mean_square(xs: List[float]) -> float:\n"
        '    """The mean of the squares of the numbers.\n    >>> mean_square([1.0, 3.0])\n    5.0\n    """\n',
        "solution": "    return sum(x * x for x in xs) / len(xs)\n",
        "inputs": [[[1.0, 3.0]], [[0.5]], [[0.1, 0.2, 0.3]], [[-2.0, 2.0, 1.5]]],
        "text": "Write a function that returns the mean of the squares of a list of numbers.",
    },
]


def _test_program(problem: dict, call: str) -> str:
    namespace: dict = {}
    exec(problem["prompt"] + problem["solution"], namespace)
    results = [namespace[problem["entry_point"]](*inp) for inp in problem["inputs"]]
    return (
        f"{CHECK}\n\ninputs = {problem['inputs']!r}\nresults = {results!r}\n"
        f"for inp, exp in zip(inputs, results):\n    _same({call}(*inp), exp, 0)\n"
    )


def humanevalplus_rows() -> list[dict]:
    return [
        {
            "task_id": f"HumanEval/{i}",
            "prompt": p["prompt"],
            "canonical_solution": p["solution"],
            "entry_point": p["entry_point"],
            "test": "\n\ndef check(candidate):\n"
            + "".join("    " + line + "\n" for line in _test_program(p, "candidate").splitlines()),
        }
        for i, p in enumerate(CODE_PROBLEMS)
    ]


def mbppplus_rows() -> list[dict]:
    rows = []
    for i, p in enumerate(CODE_PROBLEMS):
        namespace: dict = {}
        exec(p["prompt"] + p["solution"], namespace)
        asserts = [
            f"assert {p['entry_point']}({', '.join(map(repr, inp))}) == {namespace[p['entry_point']](*inp)!r}"
            for inp in p["inputs"][:3]
        ]
        rows.append(
            {
                "task_id": 2 + i,
                "code": p["prompt"].split("def ", 1)[0]
                + "def "
                + p["prompt"].split("def ", 1)[1].split('"""')[0].rstrip()
                + "\n"
                + p["solution"],
                "prompt": p["text"],
                "source_file": "written for specprefill",
                "test_imports": [],
                "test_list": asserts,
                "test": _test_program(p, p["entry_point"]),
            }
        )
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    for task in [*NIAH_TASKS, "vt", "cwe", "fwe", "qa_squad", "qa_hotpot"]:
        write(HERE / "ruler" / f"{task}.jsonl", ruler_rows(task))
    write(HERE / "gsm8k" / "main.jsonl", gsm8k_rows())
    write(HERE / "ai2_arc" / "ARC-Challenge.jsonl", arc_rows())
    write(HERE / "gpqa" / "gpqa_main.jsonl", gpqa_rows())
    write(HERE / "instruction-following-eval" / "default.jsonl", ifeval_rows())
    write(HERE / "humanevalplus" / "default.jsonl", humanevalplus_rows())
    write(HERE / "mbppplus" / "default.jsonl", mbppplus_rows())
    for subject in mmlu_subjects():
        write(HERE / "mmlu" / f"{subject}.jsonl", mmlu_rows(subject, 2, 0))


if __name__ == "__main__":
    sys.exit(main())
