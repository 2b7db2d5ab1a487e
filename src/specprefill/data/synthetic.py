"""Synthetic, seeded filler text and needle-in-a-haystack prompts (no downloads)."""

from __future__ import annotations

import random

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


def filler_text(n_chars: int, seed: int = 0) -> str:
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
