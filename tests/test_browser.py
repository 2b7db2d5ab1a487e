"""JupyterLab (headless, localhost) + Debian's Chromium driven by Playwright: the explorer notebook runs and shows
its heatmap; axe-core finds no serious accessibility fault in the heatmap page. Needs /usr/bin/chromium and axe-core
(`make setup` installs both)."""

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# as root, without a sandbox; no background connections (this machine's network refuses them)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ROOT = Path(__file__).resolve().parents[1]
# where scripts/setup.sh installs it: under the environment the tests run in (.venv, or ENV=... given to make)
AXE = Path(sys.prefix) / "npm" / "node_modules" / "axe-core" / "axe.min.js"
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian chromium not installed (apt-get install chromium)"),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path, smollm2):
    """JupyterLab serving a copy of notebooks/ and params/ (autosave must not touch the checkout)."""
    root = tmp_path / "root"
    for d in ("notebooks", "params"):
        shutil.copytree(ROOT / d, root / d)
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.open_browser=False",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "lab.log", "w"),
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("JupyterLab did not start: " + (tmp_path / "lab.log").read_text()[-2000:])
    yield url, token, root
    proc.terminate()
    proc.wait(timeout=30)


def launch(pw):
    """Debian's chromium under Playwright (no browser download)."""
    return pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def axe_violations(page, impacts=("serious", "critical")) -> list[dict]:
    """axe-core's violations of these impacts on the open page (all its rules: WCAG A/AA and best practice), each as
    axe reports it (id, impact, help, nodes). A missing axe-core fails the test rather than skipping it: CI would
    otherwise pass without checking anything."""
    if not AXE.exists():
        pytest.fail(f"axe-core is missing ({AXE}): run `make setup`", pytrace=False)
    page.add_script_tag(path=str(AXE))
    return [v for v in page.evaluate("async () => (await axe.run(document)).violations") if v["impact"] in impacts]


def test_heatmap_page_passes_axe_and_tokens_take_the_focus(tmp_path):
    """The explorer's standalone page (stats, speculator and base heatmaps: what `importance --html` writes and
    more), from synthetic scores: no serious or critical axe violation (contrast, names, roles, language), and the
    keyboard reaches a token, which announces its score."""
    from playwright.sync_api import sync_playwright
    from test_viz import make_explorer

    path = make_explorer(tmp_path)[0].save()
    with sync_playwright() as pw:
        browser = launch(pw)
        page = browser.new_page()
        page.goto(path.as_uri())
        page.keyboard.press("Tab")
        focused = page.evaluate("[document.activeElement.className, document.activeElement.getAttribute('aria-label')]")
        violations = axe_violations(page)
        browser.close()
    assert violations == [], [(v["id"], v["impact"], v["help"], len(v["nodes"])) for v in violations]
    assert focused[0].startswith("sp-tok") and ", score " in focused[1], focused


def test_explorer_notebook_renders_heatmap_in_chromium(lab, tmp_path):
    from playwright.sync_api import sync_playwright

    url, token, root = lab
    shot = tmp_path / "explorer.png"  # not under outputs/: a user's results live there
    with sync_playwright() as pw:
        browser = launch(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/lab/tree/notebooks/09_token_importance_explorer.ipynb?token={token}")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
        page.wait_for_selector("text=/\\| Idle/", timeout=120_000)  # status bar: the kernel is up
        heatmap = None
        for _attempt in range(3):  # the Run menu can be inert for a moment after the kernel connects
            page.locator(".jp-Notebook .jp-CodeCell .jp-InputArea-editor").first.click()
            page.click("text=Run", timeout=60_000)
            page.click("text=Run All Cells", timeout=60_000)
            try:
                heatmap = page.wait_for_selector(".jp-OutputArea .sp-heatmap", timeout=120_000, state="attached")
                break
            except Exception:
                page.keyboard.press("Escape")
        assert heatmap is not None, "the explorer never rendered"
        heatmap.scroll_into_view_if_needed()
        page.wait_for_timeout(1000)
        page.screenshot(path=str(shot))
        n_tokens = page.locator(".jp-OutputArea .sp-heatmap").first.locator(".sp-tok").count()
        n_kept = page.locator(".jp-OutputArea .sp-heatmap").first.locator(".sp-kept").count()
        stats = page.locator("text=/kept \\d+ of \\d+ tokens/").first.inner_text()
        browser.close()
    assert n_tokens > 100 and 0 < n_kept < n_tokens, (n_tokens, n_kept)
    assert "kept" in stats
    assert shot.stat().st_size > 10_000


def test_report_reads_at_1280_px(tmp_path):
    """The report from small synthetic outputs (`test_workbench.make_report`), at 1280x800 in Chromium: no "nan" in
    its text, no sideways scrolling of the page, every in-page link lands on an element, every figure described, the
    claims summary within the first screenful, and no serious or critical axe violation."""
    import re

    from playwright.sync_api import sync_playwright
    from test_workbench import make_report

    path = make_report(tmp_path)
    with sync_playwright() as pw:
        browser = launch(pw)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(path.as_uri())
        text = page.inner_text("body")
        widths = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        dangling = page.evaluate(
            "[...document.querySelectorAll('a[href^=\"#\"]')]"
            ".map(a => a.getAttribute('href').slice(1)).filter(id => !document.getElementById(id))"
        )
        links = page.locator('a[href^="#"]').count()
        alts = page.evaluate("[...document.images].map(i => (i.getAttribute('alt') || '').trim())")
        claims = page.locator("table.claims").bounding_box()
        violations = axe_violations(page)
        browser.close()
    assert not re.search(r"\bnan\b", text, re.IGNORECASE), re.findall(r".{40}\bnan\b", text, re.IGNORECASE)[:5]
    assert widths[0] <= widths[1], widths
    assert links > 5 and dangling == [], dangling
    assert alts and all(alts), alts
    assert claims is not None and claims["y"] < 800, claims
    assert violations == [], [(v["id"], v["impact"], v["help"], len(v["nodes"])) for v in violations]


def test_leaderboard_page_sorts_filters_draws_its_frontier_and_passes_axe(tmp_path):
    """The leaderboard's page (`workbench.board_page`) of two machines' boards in Chromium at 1280x800: a column
    sorted by its header's button (aria-sort follows), a cell read, the machine filter hiding the other machine's rows
    and points, the frontier described in text, no sideways scrolling and no serious or critical axe violation."""
    from playwright.sync_api import sync_playwright
    from test_leaderboard import a_board

    from specprefill.workbench import board, board_page

    merged = board.merge([a_board("cpu A"), a_board("cpu B")])
    fast = next(r for r in merged["rows"] if r["machine"] == "cpu B" and r["keep_rate"] == 0.1)
    fast["speedup"] = 9.0
    path = board_page.render(merged, tmp_path / "leaderboard.html")
    shown = "tbody tr:not([hidden])"
    with sync_playwright() as pw:
        browser = launch(pw)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(path.as_uri())
        header = page.locator('th[data-key="speedup"]')
        header.locator("button").click()
        ascending = header.get_attribute("aria-sort")
        header.locator("button").click()
        descending = header.get_attribute("aria-sort")
        top = page.locator(shown).first.locator("td")
        top_cells = (top.nth(0).inner_text(), top.nth(9).inner_text(), top.last.inner_text())
        points_all = page.locator("svg.frontier circle").count()
        page.select_option("#f-machine", "cpu A")
        rows_a = page.locator(shown).count()
        machines_a = set(page.locator(f"{shown} td:last-child").all_inner_texts())
        points_a = page.locator("svg.frontier circle").count()
        desc = page.locator("svg.frontier desc").first.text_content()
        best_a = page.locator("p.fastest").first.inner_text()
        verdicts = page.locator(f"{shown} td:nth-child(9)").all_inner_texts()
        kept = page.locator(f"{shown} td:nth-child(4)").all_inner_texts()
        widths = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        violations = axe_violations(page)
        browser.close()
    assert (ascending, descending) == ("ascending", "descending")
    assert top_cells == ("m", "9.00x", "cpu B")  # the fastest row first
    assert points_all == 6 and rows_a == 3 and points_a == 3 and machines_a == {"cpu A"}
    assert "on the frontier: m at keep 0.1" in desc, desc
    assert "cpu A: m at keep 0.1, 4.00x" in best_a and "cpu B" not in best_a, best_a  # follows the filter
    assert best_a.startswith("Fastest with no difference from full prefill found (the paired 95% interval within ±10")
    assert kept and all(k == "—" or 0 < float(k) <= 1 for k in kept), kept  # the kept fraction beside the asked keep
    assert all("n = " in v for v in verdicts) and any("within ±10 points, n = " in v for v in verdicts), verdicts
    assert widths[0] <= widths[1], widths
    assert violations == [], [(v["id"], v["impact"], v["help"], len(v["nodes"])) for v in violations]
