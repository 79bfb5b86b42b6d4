"""Each chapter, run the way readers run it: JupyterLab, "Run All Cells", then look at the page.

nbval proves that the notebooks execute, but never sees a widget: `Play` does not tick without a browser,
and a widget that fails to render shows nothing. One screenshot per chapter lands in browser_out/.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

from .checks import check_notebook
from .fake_player import BREAKAGES, player_notebook
from .fake_playground import BREAKAGES as PLAYGROUND_BREAKAGES
from .fake_playground import playground_notebook

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
SCREENSHOTS = ROOT / "browser_out"
# Seconds for "Run All Cells" on one notebook: a ceiling for a hung chapter, generous for a busy machine.
RUN_TIMEOUT = float(os.environ.get("PAGEDLAB_BROWSER_TIMEOUT", 600))

pytestmark = pytest.mark.browser  # `make test-fast` leaves these out


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[chapter.stem for chapter in CHAPTERS])
def test_chapter_runs_and_animates_in_jupyterlab(chapter, lab, page):
    problems = check_notebook(page, lab, f"chapters/{chapter.name}", SCREENSHOTS / f"{chapter.stem}.png", RUN_TIMEOUT)
    if problems:
        pytest.fail(str(problems), pytrace=False)


# The test of the test: a player that follows the contract passes, and each way of breaking one is caught.


def test_a_working_fake_player_passes(lab, lab_root, page):
    nbformat.write(player_notebook(), lab_root / "fake" / "working_player.ipynb")
    problems = check_notebook(page, lab, "fake/working_player.ipynb", None, RUN_TIMEOUT)
    assert not problems, str(problems)


EXPECTED_PROBLEM = {
    "render-raises": "raised RuntimeError: render is broken on purpose",
    "render-raises-after-step-0": "pressing play moved the slider to",
    "picture-fails-to-render": "rendered without its picture",
}


@pytest.mark.parametrize("breakage", [breakage for breakage in BREAKAGES if breakage])
def test_a_broken_player_fails_naming_its_notebook(breakage, lab, lab_root, page):
    name = f"broken_{breakage.replace('-', '_')}.ipynb"
    nbformat.write(player_notebook(breakage), lab_root / "fake" / name)
    problems = check_notebook(page, lab, f"fake/{name}", None, RUN_TIMEOUT)
    assert problems, f"{name} passed the browser check although its player is broken ({breakage})"
    assert str(problems).startswith(f"{name} in JupyterLab:")
    assert EXPECTED_PROBLEM[breakage] in str(problems), str(problems)


# The playground's check, tested the same way: a working panel passes; one whose run or controls do nothing fails.


@pytest.mark.parametrize("breakage", list(PLAYGROUND_BREAKAGES))
def test_the_playground_check_passes_a_working_panel_and_fails_a_broken_one(breakage, lab, lab_root, page):
    name = f"playground_{(breakage or 'working').replace('-', '_')}.ipynb"
    nbformat.write(playground_notebook(breakage), lab_root / "fake" / name)
    problems = check_notebook(page, lab, f"fake/{name}", None, RUN_TIMEOUT)
    if breakage is None:
        assert not problems, str(problems)
    else:
        assert "pressing run did not change the plots" in str(problems), str(problems)


# nbval's check, done here so that each chapter runs once: a checked cell must print what the notebook stores
# (times and the like sanitized); an unchecked cell may print anything.


@pytest.mark.parametrize("stored, passes", [("42 in 1.5 s\n", True), ("41 in 1.5 s\n", False)])
def test_a_checked_cell_must_print_its_stored_output(stored, passes, lab, lab_root, page):
    checked = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(6 * 7, 'in 0.3 s')")
    checked.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored)]
    unchecked = nbformat.v4.new_code_cell("print('anything')")
    unchecked.outputs = [nbformat.v4.new_output("stream", name="stdout", text="something else\n")]
    name = f"checked_output_{passes}.ipynb"
    notebook = nbformat.v4.new_notebook(cells=[checked, unchecked])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab_root / "fake" / name)
    problems = check_notebook(page, lab, f"fake/{name}", None, RUN_TIMEOUT)
    if passes:
        assert not problems, str(problems)
    else:
        assert "cell 0 (NBVAL_CHECK_OUTPUT) printed other stdout than stored" in str(problems), str(problems)
        assert "'42 in TIME" in str(problems), str(problems)
