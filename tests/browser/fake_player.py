"""A stand-in for a `pagedlab.viz.animate` player that follows its DOM contract, working or broken on purpose.

The contract the browser test checks: an outer container with CSS class `pagedlab-player`, holding a `Play`
jslink'ed to an `IntSlider`, an `Image` of PNG bytes with class `pagedlab-frame` re-rendered on every step,
and a text widget with class `pagedlab-events`.
"""

from __future__ import annotations

import nbformat

# Ways to break the player on purpose: (a line at the top of `render`, a line after the picture is made).
_RAISE = "raise RuntimeError('render is broken on purpose')"
BREAKAGES = {
    None: ("", ""),
    "render-raises": (f"    {_RAISE}\n", ""),  # an error output in the cell that builds the player
    "render-raises-after-step-0": (f"    if step > 0:\n        {_RAISE}\n", ""),  # the picture never changes
    "picture-fails-to-render": ("", 'frame._view_name = "NoSuchView"\n'),  # the front end cannot draw it
}

_RENDER = '''import io

import ipywidgets as widgets
import matplotlib.pyplot as plt


def render(step):
{render_breakage}    fig, ax = plt.subplots(figsize=(4, 1.5))
    ax.bar(range(8), [1 if i <= step else 0 for i in range(8)], color="tab:blue")
    ax.set_title(f"block pool at step {{step}}")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
'''

_PLAYER = """play = widgets.Play(min=0, max=7, interval=250)
slider = widgets.IntSlider(min=0, max=7)
widgets.jslink((play, "value"), (slider, "value"))
frame = widgets.Image(value=render(0), format="png")
frame.add_class("pagedlab-frame")
{frame_breakage}events = widgets.HTML("step 0")
events.add_class("pagedlab-events")


def show(change):
    frame.value = render(change["new"])
    events.value = f"step {{change['new']}}"


slider.observe(show, names="value")
player = widgets.VBox([widgets.HBox([play, slider]), frame, events])
player.add_class("pagedlab-player")
player
"""

_FIGURE = """fig, ax = plt.subplots(figsize=(4, 2))
ax.plot([0, 1, 2], [0, 1, 4])
plt.show()
"""


def player_notebook(breakage: str | None = None) -> nbformat.NotebookNode:
    """A notebook with a figure and a player; `breakage` is a key of BREAKAGES."""
    render_breakage, frame_breakage = BREAKAGES[breakage]
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("A fake player for the browser test."),
        nbformat.v4.new_code_cell(_RENDER.format(render_breakage=render_breakage)),
        nbformat.v4.new_code_cell(_FIGURE),
        nbformat.v4.new_code_cell(_PLAYER.format(frame_breakage=frame_breakage)),
    ]
    return nb
