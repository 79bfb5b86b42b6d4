"""Fixtures of the browser test: one JupyterLab server and one headless Chromium per test module, a fresh
page and kernel per notebook.

Without Chromium or Playwright the tests skip, saying how to enable them; with PAGEDLAB_BROWSER_TEST=require
(`make test-browser`, `.ci/run`) they fail instead, so that CI cannot pass without running them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from .lab import CHROMIUM_ARGS, HOW_TO_ENABLE, JupyterLab, find_chromium

ROOT = Path(__file__).resolve().parents[2]
REQUIRE_ENV = "PAGEDLAB_BROWSER_TEST"


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: runs notebooks in JupyterLab in headless Chromium")


@pytest.fixture(scope="module")
def chromium() -> str:
    """The Chromium executable; skips (or fails, where required) when it or Playwright is missing."""
    path = find_chromium()
    if importlib.util.find_spec("playwright") is None:
        missing = "Playwright is not installed"
    elif path is None:
        missing = "Chromium was not found"
    else:
        return path
    message = f"{missing}; {HOW_TO_ENABLE}"
    if os.environ.get(REQUIRE_ENV) == "require":
        pytest.fail(f"{message} ({REQUIRE_ENV}=require)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def lab_root(tmp_path_factory) -> Path:
    """What the server serves: a copy of chapters/ (JupyterLab never writes to the real notebooks), the
    benchmark files the chapters read (../docs/bench), and fake/."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "chapters", root / "chapters", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    shutil.copytree(ROOT / "docs", root / "docs")
    (root / "fake").mkdir()
    return root


@pytest.fixture(scope="module")
def lab(chromium, lab_root):
    with JupyterLab(lab_root) as server:
        yield server


@pytest.fixture(scope="module")
def browser(chromium):
    # Module scope, not session: Playwright's sync API keeps an event loop of its own, closed here before
    # nbval's kernels run.
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, lab):
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    yield page
    page.close()
    lab.shutdown_kernels()
