"""The documentation site builds with ``--strict`` from the pages as they are (a broken link or
anchor, a page missing from the nav, an API name that does not resolve: each fails), and where
Chromium is installed every page opens in it without an error (``make docs-check`` does the same
on the site ``make docs`` builds, keeping the screenshots)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from check_site import check_site, find_chromium, pages  # noqa: E402 (a script beside this test)

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(folder)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )
    return folder


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    built = set(pages(site))
    expected = {
        "",
        "getting-started/",
        "runtime/",
        "clusters/",
        "from-verl/",
        "reference/config/",
        "reference/config/async_training/",
        "reference/cli/",
        "reference/api/",
    }
    assert expected <= built, sorted(expected - built)
    api = (site / "reference" / "api" / "index.html").read_text()
    assert (
        "rlasync.runtime.LocalCluster" in api and "rlasync.config.load_config" in api
    )  # mkdocstrings rendered


def test_every_public_name_of_the_package_is_on_the_api_page() -> None:
    """``rlasync.__all__`` is the runtime a script embeds: each of its names is rendered on the
    API page (an error a caller may catch included), so none is public without a docstring shown."""
    import re

    import rlasync

    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    missing = [n for n in rlasync.__all__ if not re.search(rf"^::: rlasync[\w.]*\.{n}$", page, re.M)]
    assert not missing, f"not on docs/reference/api.md: {missing}"


@pytest.mark.skipif(
    find_chromium() is None, reason="needs chromium (apt-get install chromium; make docs-check does as root)"
)
def test_every_page_opens_in_chromium_without_an_error(site: Path) -> None:
    assert check_site(site) == []
