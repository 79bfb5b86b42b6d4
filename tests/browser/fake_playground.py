"""Notebooks with a small `pagedlab.viz.playground`, working or broken on purpose, to test the browser check.

Broken: pressing run does nothing ("run-ignored"), or the controls never reach the simulation, so a run
redraws the same plots ("controls-ignored").
"""

from __future__ import annotations

import nbformat

BREAKAGES = {
    None: "",
    "run-ignored": "panel.run_button._click_handlers.callbacks.clear()\n",
    "controls-ignored": "panel.settings = lambda: panel.base\n",
}

_PANEL = """from pagedlab.viz import playground

panel = playground(num_requests=16, request_rate=4.0, prompt_mean=64, output_mean=24)
{breakage}panel
"""


def playground_notebook(breakage: str | None = None) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("A small playground for the browser test."),
        nbformat.v4.new_code_cell(_PANEL.format(breakage=BREAKAGES[breakage])),
    ]
    return nb
