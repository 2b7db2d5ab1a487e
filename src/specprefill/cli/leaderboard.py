"""`specprefill leaderboard`: run a params profile's leaderboard (notebook 11 through papermill), merge the boards of
several runs (other machines, a cluster, a GPU) into one, and render a board as its static page."""

from __future__ import annotations

from pathlib import Path

from specprefill.cli import common
from specprefill.errors import SpecPrefillError

NOTEBOOK = "11_leaderboard"
PAGE = "leaderboard.html"


def add(sub) -> None:
    p = sub.add_parser("leaderboard", help="pruning methods side by side: run a profile's board, merge, render")
    actions = p.add_subparsers(dest="action", required=True, parser_class=common.Parser)
    r = actions.add_parser("run", help=f"notebook {NOTEBOOK} of a params profile (outputs/<profile>/{NOTEBOOK}/)")
    r.add_argument("--profile", default="cpu")
    r.add_argument("--force", action="store_true", help="compute every unit again")
    r.add_argument("--prepare-only", action="store_true", help="check the parameters without executing")
    r.add_argument(
        "--data-dir",
        default=None,
        help="read hub datasets (a group's LongBench tasks) from this directory in their own schema",
    )
    r.add_argument(
        "--groups",
        type=lambda text: [g.strip() for g in text.split(",") if g.strip()],
        default=None,
        help="run these of the profile's task groups alone, comma-separated (their rows merge with another run's)",
    )
    r.add_argument(
        "--prompts",
        default=None,
        metavar="FILE.jsonl",
        help="your own prompts as the board's task groups, in place of the profile's: one JSON object a line with "
        '"prompt" or "messages", "answers", optionally "metric" and "group" (written below the board\'s folder)',
    )
    m = actions.add_parser("merge", help="one board (board.json, board.csv and the page) from several runs' boards")
    m.add_argument("boards", nargs="+", help="board.json files (or the folders holding them)")
    m.add_argument("-o", "--output", required=True, help="the folder to write the merged board and its page to")
    v = actions.add_parser("render", help=f"a board's page ({PAGE}, beside the board unless -o names a file)")
    v.add_argument("board", help="a board.json (or the folder holding one)")
    v.add_argument("-o", "--output", default=None)
    for q in (r, m, v):
        q.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> dict:
    from specprefill.workbench import board, board_page  # lazy: pandas

    if args.action == "run":
        from specprefill.workbench import runner  # lazy: papermill

        groups = args.groups
        if args.prompts is not None:
            if groups is not None:
                raise SpecPrefillError("--prompts replaces the profile's groups: leave --groups out")
            groups = prompt_groups(args.profile, args.prompts)
        if groups is not None:  # a group the profile lacks: one line before anything runs
            params = runner.notebook_params(runner.project_root(), args.profile, NOTEBOOK, groups=groups)
        failures = runner.run_profile(
            args.profile,
            [NOTEBOOK],
            args.force,
            args.prepare_only,
            recompute=args.force,
            data_dir=args.data_dir,
            groups=groups,
        )
        if failures:
            raise SpecPrefillError(
                f"{NOTEBOOK} failed: open outputs/{args.profile}/{NOTEBOOK}/{NOTEBOOK}.failed.ipynb, fix, and rerun "
                f"({failures[0][1]})"
            )
        where = Path(params["output_dir"]) if groups is not None else Path("outputs") / args.profile / NOTEBOOK
        return {
            "action": "run",
            "profile": args.profile,
            "prepare_only": bool(args.prepare_only),
            "page": str(where / PAGE),
        }
    if args.action == "merge":
        from specprefill.workbench import plots  # lazy: matplotlib

        merged = board.merge([board.load(b) for b in args.boards], names=list(args.boards))
        out = Path(args.output)
        board.save(merged, out)
        page = board_page.render(merged, out / PAGE)
        plots.board_frontier(merged["rows"], out / "board_frontier.png")  # every figure of the board, redrawn
        return {
            "action": "merge",
            "machines": sorted(merged["machines"]),
            "rows": len(merged["rows"]),
            "page": str(page),
        }
    loaded = board.load(args.board)
    src = Path(args.board)
    target = Path(args.output) if args.output else (src if src.is_dir() else src.parent) / PAGE
    return {"action": "render", "rows": len(loaded["rows"]), "page": str(board_page.render(loaded, target))}


def prompt_groups(profile: str, path: str) -> dict:
    """The board's task groups of a user's prompts file, every line checked, lengths in the profile's base tokens."""
    from specprefill.data import userprompts  # lazy: the CLI's --help loads no workbench
    from specprefill.engines.common import load_tokenizer  # lazy: transformers
    from specprefill.models import resolve  # lazy: torch
    from specprefill.workbench import runner  # lazy: papermill

    rows = userprompts.read(path)  # every line checked before the tokenizer loads
    base = runner.notebook_params(runner.project_root(), profile, NOTEBOOK).get("base")
    if not base:
        raise SpecPrefillError(f"profile {profile}: {NOTEBOOK} names no base model to count the prompts' tokens with")
    groups = userprompts.board_groups(path, load_tokenizer(resolve(base)))
    assert sum(g["n"] for g in groups.values()) == len(rows)
    return groups


def human(result: dict) -> str:
    if result["action"] == "run":
        if result["prepare_only"]:
            return f"profile {result['profile']}: the leaderboard's parameters checked (nothing run)"
        return f"leaderboard of profile {result['profile']}: {result['page']}"
    if result["action"] == "merge":
        return f"{result['rows']} rows from {len(result['machines'])} machine(s): {result['page']}"
    return f"{result['rows']} rows: {result['page']}"
