"""A follow-up turn: the document and a first question in the first user message, the (right) answer as the
assistant's turn, then a second question about another fact of the document, alone in the last user message. What
a served conversation's second request looks like when it is speculated afresh: the question sits far from the
document it asks about, after a turn that answers something else."""

from __future__ import annotations

from specprefill.data import synthetic
from specprefill.data.ruler import fit

TASK = "follow_up"
CHARS_PER_UNIT = 200  # the document grows in steps of this many characters while it is fitted to the length


def prompt(tokenizer, conversation: synthetic.Conversation) -> str:
    """The chat template over turn 1 (document and question), its answer, and turn 2's question."""
    messages = [
        {"role": "user", "content": conversation.message(0)},
        {"role": "assistant", "content": conversation.answers[0]},
        {"role": "user", "content": conversation.message(1)},
    ]
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text


def generate(tokenizer, length: int, n: int, seed: int = 0) -> list[dict]:
    """n follow-up prompts within `length` tokens (as the tokenizer counts them), each its own seeded document; the
    answer is turn 2's code word, scored as RULER's "all" (found in the reply)."""
    out = []
    for i in range(n):
        conv_seed = hash_seed(seed, i)
        built: dict[str, synthetic.Conversation] = {}

        def build(units: int, conv_seed=conv_seed, built=built) -> str:
            conv = synthetic.conversation(units * CHARS_PER_UNIT, turns=2, seed=conv_seed)
            text = prompt(tokenizer, conv)
            built[text] = conv
            return text

        text, tokens = fit(tokenizer, build, length, max(1, 8 * length // CHARS_PER_UNIT))
        conv = built[text]
        out.append(
            {
                "task": TASK,
                "index": i,
                "input": text,
                "outputs": [conv.answers[1]],
                "metric": "all",
                "length": tokens,
                "target_length": length,
            }
        )
    return out


def hash_seed(seed: int, index: int) -> int:
    """One prompt's conversation seed from the run's seed and its index (distinct for every pair)."""
    return seed * 1_000_003 + index
