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

        if args.groups is not None:  # a group the profile lacks: one line before anything runs
            runner.notebook_params(runner.project_root(), args.profile, NOTEBOOK, groups=args.groups)
        failures = runner.run_profile(
            args.profile,
            [NOTEBOOK],
            args.force,
            args.prepare_only,
            recompute=args.force,
            data_dir=args.data_dir,
            groups=args.groups,
        )
        if failures:
            raise SpecPrefillError(
                f"{NOTEBOOK} failed: open outputs/{args.profile}/{NOTEBOOK}/{NOTEBOOK}.failed.ipynb, fix, and rerun "
                f"({failures[0][1]})"
            )
        where = Path("outputs") / args.profile / NOTEBOOK
        return {
            "action": "run",
            "profile": args.profile,
            "prepare_only": bool(args.prepare_only),
            "page": str(where / PAGE),
        }
    if args.action == "merge":
        merged = board.merge([board.load(b) for b in args.boards], names=list(args.boards))
        out = Path(args.output)
        board.save(merged, out)
        page = board_page.render(merged, out / PAGE)
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


def human(result: dict) -> str:
    if result["action"] == "run":
        if result["prepare_only"]:
            return f"profile {result['profile']}: the leaderboard's parameters checked (nothing run)"
        return f"leaderboard of profile {result['profile']}: {result['page']}"
    if result["action"] == "merge":
        return f"{result['rows']} rows from {len(result['machines'])} machine(s): {result['page']}"
    return f"{result['rows']} rows: {result['page']}"
