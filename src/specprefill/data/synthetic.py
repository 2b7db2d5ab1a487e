"""Synthetic, seeded filler text and needle-in-a-haystack prompts (no downloads)."""

from __future__ import annotations

import random
from dataclasses import dataclass

SUBJECTS = [
    "The old miller",
    "A young sailor",
    "The village doctor",
    "Our neighbour",
    "The baker's daughter",
    "A travelling merchant",
    "The schoolteacher",
    "The harbour master",
]
VERBS = ["walked to", "wrote a letter about", "painted", "complained about", "sold", "repaired", "visited"]
OBJECTS = [
    "the stone bridge",
    "the northern market",
    "a broken clock",
    "the lighthouse",
    "the orchard",
    "an old violin",
    "the town hall",
    "a red bicycle",
    "the river mill",
]
TIMES = ["in the morning", "after the storm", "on Sunday", "before dinner", "during the festival", "at dusk"]
QUESTION = "\n\nQuestion: What is the secret passphrase mentioned in the text above?\nAnswer: The secret passphrase is"


def filler_text(n_chars: int, seed: int | str = 0) -> str:
    """Plausible, varied English sentences, at least n_chars long, the same for the same seed."""
    rng = random.Random(seed)
    sentences, size = [], 0
    while size < n_chars:
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TIMES)}."
        sentences.append(s)
        size += len(s) + 1
    return " ".join(sentences)


def needle_prompt(n_chars: int, needle: str, depth: float, seed: int = 0, question: str = QUESTION) -> str:
    """Filler of n_chars with `needle` inserted at relative `depth` (0 = start, 1 = end), then the question."""
    text = filler_text(n_chars, seed)
    cut = int(len(text) * depth)
    return text[:cut] + " " + needle + " " + text[cut:] + question


def prompt_of_tokens(tokenizer, n_tokens: int, seed: int = 0) -> list[int]:
    """Token ids of exactly n_tokens: seeded filler text, tokenized and cut (for benchmarks)."""
    ids: list[int] = []
    chars = n_tokens * 6
    while len(ids) < n_tokens:
        ids = list(tokenizer(filler_text(chars, seed))["input_ids"])
        chars *= 2
    return ids[:n_tokens]


def sample_prompts() -> dict[str, str]:
    """A few offline prompts for interactive exploration."""
    return {
        "needle, 2k chars": needle_prompt(2000, "The secret passphrase is 'amber falcon 7'.", 0.5, seed=1),
        "needle, 8k chars": needle_prompt(8000, "The secret passphrase is 'copper lantern'.", 0.3, seed=2),
        "variable tracking": (
            "VAR A = 18. "
            + filler_text(1500, seed=3)
            + " VAR B = VAR A. "
            + filler_text(1500, seed=4)
            + " VAR C = VAR B.\n\nQuestion: Which variables hold the value 18?\nAnswer:"
        ),
    }


CODE_WORDS = [
    "amber", "cobalt", "juniper", "saffron", "granite", "orchid", "falcon", "meridian",
    "tundra", "velvet", "quartz", "lagoon", "thistle", "ember", "harbor", "zephyr",
]  # fmt: skip
FIRST_ANSWER = "Which code word did you give in your first answer? Reply with the code word only."


@dataclass(frozen=True)
class Conversation:
    """A document and the user's turns: `questions[t]` expects `answers[t]` (a code word) somewhere in the reply.
    Turn 1's message is the document followed by its question; later turns send the question alone."""

    document: str
    questions: list[str]
    answers: list[str]
    materials: tuple[str, ...] = ()  # an agent's turns >= 2: new material (a tool's output) before the question

    def message(self, turn: int) -> str:
        if turn == 0:
            return f"{self.document}\n\n{self.questions[turn]}"
        if self.materials:
            return f"{self.materials[turn - 1]}\n\n{self.questions[turn]}"
        return self.questions[turn]


def _with_fact(text: str, depth: float, subject: str, word: str) -> str:
    """`text` with "The code word of <subject> is <word>." at a sentence boundary near relative `depth`."""
    cut = text.rfind(". ", 0, int(len(text) * depth)) + 1 if depth > 0 else 0
    return f"{text[:cut]} The code word of {subject.lower()} is {word}.{text[cut:]}"


def _ask(subject: str) -> str:
    return f"What is the code word of {subject.lower()}? Reply with the code word only."


def conversation(n_chars: int, turns: int, seed: int = 0, recall_first: bool = True) -> Conversation:
    """A seeded multi-turn conversation over one document: filler of `n_chars` with one code word per subject
    inserted at spread depths (deep ones included); each turn asks for another subject's code word, and the third
    turn (when there is one, and `recall_first`) asks for the code word of the first answer, found in the
    conversation, not the document. Without `recall_first`: every question about another fact of the document (the
    questions of different users on one shared document)."""
    if turns < 1:
        raise ValueError(f"turns {turns} must be >= 1")
    rng = random.Random(seed)
    n_facts = max(1, turns - (turns >= 3 and recall_first))
    subjects = rng.sample(SUBJECTS, min(n_facts, len(SUBJECTS)))
    subjects = [subjects[i % len(subjects)] for i in range(n_facts)]
    words = rng.sample(CODE_WORDS, n_facts)
    depths = sorted((i + rng.random()) / n_facts for i in range(n_facts))
    rng.shuffle(depths)  # the first question is not always about the earliest fact
    text = filler_text(n_chars, seed)
    inserts = sorted(zip(depths, subjects, words), reverse=True)
    for depth, subject, word in inserts:  # from the end: earlier offsets stay valid
        text = _with_fact(text, depth, subject, word)
    questions, answers = [], []
    facts = iter(zip(subjects, words))
    for t in range(turns):
        if t == 2 and recall_first:
            questions.append(FIRST_ANSWER)
            answers.append(words[0])
        else:
            subject, word = next(facts)
            questions.append(_ask(subject))
            answers.append(word)
    return Conversation(text.strip(), questions, answers)


def agent_conversation(n_chars: int, new_chars: int, turns: int, seed: int = 0) -> Conversation:
    """A seeded agent loop: turn 1 a document of `n_chars` and a question about one fact in it; each later turn
    appends new material of `new_chars` (a tool's output, one fact of another subject at a random depth) and asks
    about that fact, so the answer is in what the turn added. Subjects and code words differ across turns."""
    if not 1 <= turns <= min(len(SUBJECTS), len(CODE_WORDS)):
        raise ValueError(f"turns {turns} must be in 1..{min(len(SUBJECTS), len(CODE_WORDS))}")
    rng = random.Random(f"agent-{seed}")
    subjects, words = rng.sample(SUBJECTS, turns), rng.sample(CODE_WORDS, turns)
    texts = [
        _with_fact(filler_text(new_chars if t else n_chars, f"agent-{seed}-{t}"), rng.random(), subjects[t], words[t])
        for t in range(turns)
    ]
    materials = tuple(f"Tool output {t}:\n{text.strip()}" for t, text in enumerate(texts[1:], 1))
    return Conversation(texts[0].strip(), [_ask(s) for s in subjects], list(words), materials)
