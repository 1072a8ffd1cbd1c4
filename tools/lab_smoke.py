"""Headless JupyterLab smoke test of one lesson, as a student would see it (not part of `make test`).

Start JupyterLab first (`make lab`, or `jupyter lab --port 8899 --no-browser`), then
    python tools/lab_smoke.py "http://127.0.0.1:8899/lab/tree/06_sampling.ipynb?reset&token=..." out_dir
It runs all cells, waits for a live slider and a rendered plotly figure, moves the first slider
one step with the keyboard, checks that the panel's figure changed, and saves screenshots.
Drives Debian's chromium (it never downloads a browser).
"""

import shutil
import sys
import time

from playwright.sync_api import sync_playwright


def main(url: str, out: str = ".") -> int:
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium"), headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1400, "height": 2000})
        page.goto(url)
        page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
        try:  # JupyterLab 4 may ask which kernel to use for a notebook without a session
            page.locator(".jp-Dialog button", has_text="Select").click(timeout=5_000)
        except Exception:
            pass
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                               state="attached", timeout=60_000)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        page.wait_for_selector(".noUi-handle", timeout=120_000)
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)
        time.sleep(5)
        print("plotly figures rendered:", page.locator(".js-plotly-plot").count())
        panel = page.locator(".widget-interact").first
        panel.scroll_into_view_if_needed()
        before = panel.locator(".gtitle").all_text_contents()
        panel.screenshot(path=f"{out}/lab_panel_before.png")
        handle = panel.locator(".noUi-handle").first
        handle.focus()
        handle.press("ArrowRight")
        time.sleep(3)
        after = panel.locator(".gtitle").all_text_contents()
        panel.screenshot(path=f"{out}/lab_panel_after.png")
        print("panel figure title before:", before)
        print("panel figure title after: ", after)
        browser.close()
    return 0 if before and after and before != after else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
