"""EvalPlus's HumanEval+ and MBPP+ as lm-eval tasks (the hub's `evalplus/humanevalplus` and `evalplus/mbppplus`
rows): EvalPlus's chat prompt (its instruction, the problem in a code block, the answer opened as a Python block),
the program taken from the answer as EvalPlus sanitizes it (`metrics.definitions`), and its tests — the original
tests plus EvalPlus's added inputs, compared with numpy where outputs are floats — run in specprefill's sandbox."""

from specprefill.data import metrics

INSTRUCTION = (
    "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
)
TIMEOUT_S = 30.0  # per problem: every base and added input in one sandboxed run
MEMORY_MB, PROCESSES = 4096, 2  # the test programs hold megabytes of literal inputs: room to compile them


def _prompt(problem: str) -> str:
    return f"{INSTRUCTION}\n```\n{problem.strip()}\n```"


def humaneval_prompt(doc: dict) -> str:
    return _prompt(doc["prompt"])


def mbpp_prompt(doc: dict) -> str:
    """EvalPlus's MBPP+ problem: the description and its first assertion in a docstring."""
    return _prompt(f'"""\n{doc["prompt"].strip()}\n{doc["test_list"][0].strip()}\n"""\n')


def humaneval_tests(doc: dict) -> str:
    return f"{doc['test']}\n\ncheck({doc['entry_point']})\n"


def mbpp_tests(doc: dict) -> str:
    return "\n".join(list(doc.get("test_imports") or []) + [doc["test"]]) + "\n"


def programs(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    return [[metrics.definitions(r) for r in resp] for resp in resps]


def pass_at_1(references: list[str], predictions: list) -> float:
    """1.0 when the program passes every test in the sandbox, else 0.0."""
    program = predictions[0][0] if isinstance(predictions[0], list) else predictions[0]
    return metrics.pass_at_1(program, references[0], TIMEOUT_S, ("numpy",), MEMORY_MB, PROCESSES) / 100.0
