"""Peak memory of a command and every process it starts: `python scripts/peak_memory.py -- specprefill generate ...`.

Samples the process tree every 0.1 s and prints (to stderr, and as JSON with --json FILE) the peak of the summed RSS
and of the summed PSS (shared pages split between the processes sharing them, so PSS adds up to what the tree really
holds; RSS counts a shared page once per process), and each process's own peak. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _children(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _kib(pid: int, field: str, file: str) -> int:
    try:
        with open(f"/proc/{pid}/{file}") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:80].strip()
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    start = time.monotonic()
    proc = subprocess.Popen(cmd)
    peak_rss = peak_pss = 0
    per: dict[int, dict] = {}
    timeline = []
    while proc.poll() is None:
        rss = pss = 0
        for pid in _children(proc.pid):
            r, p = _kib(pid, "VmRSS:", "status"), _kib(pid, "Pss:", "smaps_rollup")
            rss, pss = rss + r, pss + p
            entry = per.setdefault(pid, {"cmd": _name(pid), "peak_rss_gib": 0.0, "peak_pss_gib": 0.0})
            entry["peak_rss_gib"] = max(entry["peak_rss_gib"], r / 2**20)
            entry["peak_pss_gib"] = max(entry["peak_pss_gib"], p / 2**20)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        timeline.append(
            (
                round(time.monotonic() - start, 1),
                round(rss / 2**20, 2),
                round(pss / 2**20, 2),
                round(_kib(proc.pid, "VmRSS:", "status") / 2**20, 2),
            )
        )
        time.sleep(args.interval)
    result = {
        "command": cmd,
        "returncode": proc.returncode,
        "seconds": round(time.monotonic() - start, 1),
        "peak_rss_gib": round(peak_rss / 2**20, 2),
        "peak_pss_gib": round(peak_pss / 2**20, 2),
        "processes": sorted(per.values(), key=lambda e: -e["peak_pss_gib"]),
        "timeline_s_rss_pss_main_rss_gib": timeline,
    }
    print(
        f"peak RSS {result['peak_rss_gib']} GiB, peak PSS {result['peak_pss_gib']} GiB (sum over the process tree), "
        f"{result['seconds']} s, exit {proc.returncode}",
        file=sys.stderr,
    )
    for e in result["processes"][:8]:
        print(f"  {e['peak_pss_gib']:6.2f} GiB PSS {e['peak_rss_gib']:6.2f} GiB RSS  {e['cmd']}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
