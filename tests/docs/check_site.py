"""The built documentation site, looked at as a reader would: every page opened in headless
Chromium (Playwright driving the system's browser, Debian's ``chromium``), served over HTTP as
a web server would serve it.

    python tests/docs/check_site.py site [--screenshots site/screenshots]   # what `make docs-check` runs

A page fails when it does not load (a status other than 200), has no title heading, logs a
console error or an uncaught exception, or requests something that fails (a missing asset, a
resource on the internet). The search must find ``staleness_threshold`` on the configuration
reference. With ``--screenshots``, each page's first screen is written there as a PNG named
after its path (``getting-started.png``, ``reference-config-index.png``). Exit status 1 and one
line per problem when anything fails; every wait has a deadline.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PAGE_TIMEOUT_MS = 30_000
SEARCH_TERM = "staleness_threshold"
SEARCH_PAGE = "reference/config/async_training/"
"""Where the search must find ``SEARCH_TERM`` (its setting's own section)."""
SKIPPED = ("assets", "search")
"""Folders of the built site that hold no pages."""


def find_chromium() -> str | None:
    """The browser to drive: ``RLASYNC_CHROMIUM``, else ``chromium`` (Debian) on the PATH."""
    found = os.environ.get("RLASYNC_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    return found if found and Path(found).exists() else None


def pages(site: Path) -> list[str]:
    """Every page of the site as a URL path relative to its root (``""`` is the home page)."""
    found = []
    for index in sorted(site.rglob("index.html")):
        relative = index.parent.relative_to(site)
        if relative.parts and relative.parts[0] in SKIPPED:
            continue
        found.append("" if not relative.parts else relative.as_posix() + "/")
    return found


def screenshot_name(page: str) -> str:
    return (page.strip("/").replace("/", "-") or "index") + ".png"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


@contextmanager
def serve(site: Path) -> Iterator[str]:
    """The site over HTTP on a free loopback port, for as long as the block runs."""
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def check_site(site: Path, screenshots: Path | None = None, chromium: str | None = None) -> list[str]:
    """Open every page of ``site``; the problems found, one line each (none: the site is fine)."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    browser_path = chromium or find_chromium()
    if browser_path is None:
        return [
            "no chromium to drive: apt-get install chromium (or set RLASYNC_CHROMIUM to a Chromium binary)"
        ]
    if screenshots is not None:
        screenshots.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with serve(site) as root, sync_playwright() as playwright:
        # --no-sandbox: Chromium refuses to start its sandbox as root (CI); the pages are our own.
        browser = playwright.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            context.set_default_timeout(PAGE_TIMEOUT_MS)
            for path in pages(site):
                problems += _check_page(context, root, path, screenshots)
            problems += _check_search(context, root)
        except PlaywrightError as exc:
            problems.append(f"the browser failed: {exc}")
        finally:
            browser.close()
    return problems


def _check_page(context, root: str, path: str, screenshots: Path | None) -> list[str]:  # type: ignore[no-untyped-def]
    page = context.new_page()
    seen: list[str] = []
    page.on("console", lambda m: seen.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda exc: seen.append(f"uncaught exception: {exc}"))
    page.on("requestfailed", lambda r: seen.append(f"request failed: {r.url} ({r.failure})"))
    try:
        response = page.goto(root + path, wait_until="load")
        page.wait_for_load_state("networkidle")
        if response is None or response.status != 200:
            seen.append(f"status {response.status if response else 'none'}")
        if page.locator("article h1").count() == 0:
            seen.append("no title heading (h1) in the page's article")
        if screenshots is not None:
            page.screenshot(path=str(screenshots / screenshot_name(path)))
    finally:
        page.close()
    return [f"/{path}: {line}" for line in seen]


def _check_search(context, root: str) -> list[str]:  # type: ignore[no-untyped-def]
    """Type the term into the site's search box, as a reader does; the setting's page must be a hit."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page = context.new_page()
    targets: list[str] = []
    try:
        page.goto(root + "reference/config/", wait_until="load")
        box = page.locator("input.md-search__input")
        hits = page.locator(".md-search-result__item a")
        deadline = time.monotonic() + PAGE_TIMEOUT_MS / 1000
        while time.monotonic() < deadline:  # typed again until the search index (built in a worker) answers
            box.click()
            box.fill("")
            box.type(SEARCH_TERM)
            try:
                hits.first.wait_for(state="attached", timeout=5_000)
            except PlaywrightTimeout:
                continue
            # The list is re-rendered while the search settles (CI once saw it shrink between a
            # count and a read by index): its links are read in one go, and read again until the
            # setting's page is among them or the deadline passes.
            while time.monotonic() < deadline:
                targets = hits.evaluate_all("links => links.map(a => a.getAttribute('href') || '')")
                if any(SEARCH_PAGE in target for target in targets):
                    return []
                page.wait_for_timeout(250)
    finally:
        page.close()
    if not targets:
        return [f"search for {SEARCH_TERM!r} found nothing within {PAGE_TIMEOUT_MS / 1000:.0f} s"]
    return [f"search for {SEARCH_TERM!r} did not find {SEARCH_PAGE} (hits: {targets[:5]})"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the folder `mkdocs build` wrote (site/)")
    parser.add_argument("--screenshots", type=Path, help="write each page's first screen here")
    args = parser.parse_args()
    if not (args.site / "index.html").exists():
        print(f"{args.site}/index.html is missing: build the site first (make docs)", file=sys.stderr)
        return 1
    problems = check_site(args.site, args.screenshots)
    for line in problems:
        print(line, file=sys.stderr)
    count = len(pages(args.site))
    print(
        f"{count} pages opened in Chromium: {'no problem' if not problems else f'{len(problems)} problems'}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
