"""What a notebook must show in JupyterLab after "Run All Cells", checked in the page.

- every code cell ran, and none has an error output;
- every cell marked `# NBVAL_CHECK_OUTPUT` printed what the notebook stores, after the substitutions of
  chapters/sanitize.cfg (times, addresses, long floats, rates): nbval's lax check, so that `make test` runs each
  chapter once, here, instead of once under nbval and once in the browser;
- every widget output rendered (a widget that fails to render shows an error or nothing);
- every figure (image/png output) is in the page and loaded;
- every animation player (`.pagedlab-player`, the DOM contract of `pagedlab.viz.animate`) has its play
  button, slider, picture and event text, and pressing play advances the slider and changes the picture;
- every playground (`.pagedlab-playground`, the DOM contract of `pagedlab.viz.playground`): moving its KV
  budget slider and pressing run changes the plots, and no error shows in its status line.
"""

from __future__ import annotations

import configparser
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .lab import JupyterLab, run_all_cells, wait_for

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SANITIZE = Path(__file__).resolve().parents[2] / "chapters" / "sanitize.cfg"

PLAY_BUTTON = ".widget-play button:has(.fa-play)"
PAUSE_BUTTON = ".widget-play button:has(.fa-pause)"
SLIDER_HANDLE = ".widget-slider [role=slider]"
FRAME = "img.pagedlab-frame"
EVENTS = ".pagedlab-events"


@dataclass
class Problems:
    """What is wrong with one notebook, each line under its name; empty (falsy) when nothing is."""

    name: str
    items: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.items.append(text)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __str__(self) -> str:
        return f"{self.name} in JupyterLab:\n" + "\n".join(f"  - {item}" for item in self.items)


def check_notebook(page, lab: JupyterLab, notebook: str, screenshot: Path | None, timeout: float) -> Problems:
    """Run `notebook` (a path under the server's root) in `page` and return what is wrong with it."""
    from playwright.sync_api import Error as PlaywrightError  # imported here: without it the tests skip

    problems = Problems(Path(notebook).name)
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    try:
        state = run_all_cells(page, lab, notebook, timeout)
        _check_cells(state, problems)
        _check_outputs(state, lab.root_dir / notebook, problems)
        _check_widgets_rendered(page, state, problems)
        _check_figures(page, state, problems)
        _check_players(page, problems)
        _check_playgrounds(page, problems)
    except (TimeoutError, PlaywrightError) as error:  # the page never got there, or an element never came
        problems.add(f"{type(error).__name__}: {str(error).strip()[:1000]}")
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        figure = '.jp-OutputArea-output[data-mime-type="image/png"]'
        for selector in (".pagedlab-player", ".pagedlab-playground", figure):
            shown = page.locator(selector).filter(visible=True)
            if shown.count():  # the first player, else the first figure
                try:
                    shown.first.scroll_into_view_if_needed(timeout=5000)
                except PlaywrightError:
                    pass  # the screenshot is for people; whatever it shows, it is taken
                break
        page.screenshot(path=str(screenshot))
    if problems and page_errors:
        problems.add("errors in the page: " + "; ".join(page_errors[:5]))
    return problems


def _check_cells(state: dict, problems: Problems) -> None:
    for cell in state["cells"]:
        for out in cell["outputs"]:
            if out["type"] == "error":
                tail = "\n      ".join(ANSI.sub("", out["traceback"]).strip().splitlines()[-6:])
                problems.add(f"cell {cell['index']} raised {out['ename']}: {out['evalue']}\n      {tail}")
    if not any(out["type"] == "error" for cell in state["cells"] for out in cell["outputs"]):
        unrun = [cell["index"] for cell in state["cells"] if cell["count"] is None]
        if unrun:
            problems.add(f"cells {unrun} did not run")


def sanitize_patterns(path: Path = SANITIZE) -> list[tuple[str, str]]:
    """The (regex, replacement) pairs of an nbval sanitize file, in order."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(path)
    return [(parser[name]["regex"], parser[name]["replace"]) for name in parser.sections()]


def output_texts(outputs, patterns) -> dict[str, list[str]]:
    """A cell's outputs as nbval compares them: each text by stream name or MIME type, in order, streams of one
    name joined, widgets left out, every text sanitized. `outputs` are nbformat dicts (stored) or the page's
    (a `text` dict per output)."""
    texts: dict[str, list[str]] = {}
    for out in outputs:
        if "text" in out and isinstance(out["text"], dict):  # read from the page
            pieces = out["text"]
        elif out.get("output_type") == "stream":
            pieces = {out["name"]: out["text"]}
        elif WIDGET_MIME in out.get("data", {}):
            continue  # a widget (a progress bar, say): nbval skips it too
        else:
            pieces = {mime: value for mime, value in out.get("data", {}).items() if mime.startswith("text/")}
        for key, value in pieces.items():
            value = "".join(value) if isinstance(value, list) else value
            if key in ("stdout", "stderr") and key in texts:
                texts[key][-1] += value
            else:
                texts.setdefault(key, []).append(value)
    for values in texts.values():
        for regex, replace in patterns:
            values[:] = [re.sub(regex, replace, value) for value in values]
    return texts


def _check_outputs(state: dict, stored_path: Path, problems: Problems) -> None:
    if not stored_path.exists():
        return
    stored = json.loads(stored_path.read_text())["cells"]
    patterns = sanitize_patterns()
    for cell in state["cells"]:
        if not cell["checked"] or any(out["type"] == "error" for out in cell["outputs"]):
            continue  # an error is reported by _check_cells
        want = output_texts(stored[cell["index"]].get("outputs", []), patterns)
        got = output_texts(cell["outputs"], patterns)
        if want != got:
            problems.add(f"cell {cell['index']} (NBVAL_CHECK_OUTPUT) printed {_first_difference(want, got)}")


def _first_difference(want: dict, got: dict) -> str:
    for key in sorted(set(want) | set(got)):
        w, g = "".join(want.get(key, [])), "".join(got.get(key, []))
        if w != g:
            w_lines, g_lines = w.splitlines() + [""], g.splitlines() + [""]
            at = next(i for i, (a, b) in enumerate(zip(w_lines, g_lines)) if a != b)
            return (f"other {key} than stored, from line {at + 1}: {g_lines[at][:160]!r} "
                    f"instead of {w_lines[at][:160]!r}")
    return "other outputs than stored"


def _count_outputs(state: dict, mime: str, unless: str | None = None) -> int:
    """Outputs that carry `mime` (and not `unless`)."""
    return sum(
        mime in out["mimes"] and unless not in out["mimes"] for cell in state["cells"] for out in cell["outputs"]
    )


def _check_widgets_rendered(page, state: dict, problems: Problems) -> None:
    expected = _count_outputs(state, WIDGET_MIME)
    # A widget output that fails as a whole shows "Error displaying widget" text instead of a widget.
    rendered = page.locator(".jp-OutputArea-output > .jupyter-widgets").count()
    if rendered < expected:
        problems.add(f"{rendered} of {expected} widget outputs are in the page")
    # A widget (or a child of a box) whose view fails shows ipywidgets' error sign; a click shows why.
    errors = page.locator(".jupyter-widgets-error-widget")
    for i in range(errors.count()):
        errors.nth(i).click()
        problems.add(f"a widget failed to render: {errors.nth(i).inner_text().strip()[:300]}")


def _check_figures(page, state: dict, problems: Problems) -> None:
    # A player's output also carries a PNG strip for readers without a kernel; JupyterLab shows the widget.
    expected = _count_outputs(state, "image/png", unless=WIDGET_MIME)
    images = page.locator('.jp-OutputArea-output[data-mime-type="image/png"] img')
    loaded = sum(images.nth(i).evaluate("img => img.complete && img.naturalWidth > 0") for i in range(images.count()))
    if loaded < expected:
        problems.add(f"{loaded} of {expected} figures (image/png outputs) are in the page")


def _check_players(page, problems: Problems) -> None:
    players = page.locator(".pagedlab-player")
    for i in range(players.count()):
        name = f"player {i + 1} of {players.count()}"
        player = players.nth(i)
        player.scroll_into_view_if_needed()
        missing = _missing_parts(player, [("play button", PLAY_BUTTON), ("slider", SLIDER_HANDLE), ("picture", FRAME),
                                          ("event text", EVENTS)])
        if missing:
            problems.add(f"{name} rendered without its {', '.join(missing)}")
            continue
        frame = player.locator(FRAME).first
        if not image_loaded(page, frame):
            problems.add(f"{name}: the picture never loaded")
            continue
        _check_play(page, player, name, problems)


def _missing_parts(element, parts: list[tuple[str, str]]) -> list[str]:
    """The names of the (name, CSS selector) parts that `element` does not contain."""
    return [name for name, selector in parts if not element.locator(selector).count()]


def image_loaded(page, image, timeout: float = 10) -> bool:
    """Whether the <img> `image` finishes loading a picture within `timeout` seconds."""
    return wait_for(page, lambda: image.evaluate("img => img.complete && img.naturalWidth > 0"), timeout=timeout)


def _check_play(page, player, name: str, problems: Problems) -> None:
    """Press play; the slider must advance and the picture change, then pause the player again."""
    handle = player.locator(SLIDER_HANDLE).first
    frame = player.locator(FRAME).first
    slider_value = lambda: float(handle.get_attribute("aria-valuenow"))  # noqa: E731
    start_value = slider_value()
    start_picture = frame.screenshot()
    player.locator(PLAY_BUTTON).first.click()
    try:
        if not wait_for(page, lambda: slider_value() > start_value, timeout=15):
            problems.add(f"{name}: pressing play did not advance the slider (stuck at {start_value:g})")
            return
        if not wait_for(page, lambda: frame.screenshot() != start_picture, timeout=10, interval=0.5):
            problems.add(
                f"{name}: pressing play moved the slider to {slider_value():g} but the picture did not change "
                "(does the render function raise? see the kernel log)"
            )
    finally:
        pause = player.locator(PAUSE_BUTTON)
        if pause.count():
            pause.first.click()


PLAYGROUND_SLIDER = ".pagedlab-control-kv_slots [role=slider]"
PLAYGROUND_PLOTS = "img.pagedlab-playground-plots"


def _check_playgrounds(page, problems: Problems) -> None:
    """Move the KV budget slider one notch down (the keyboard, as a reader would), press run, and wait for the
    plots to change (a run simulates and redraws in the kernel: seconds on a busy machine)."""
    panels = page.locator(".pagedlab-playground")
    for i in range(panels.count()):
        _check_playground(page, panels.nth(i), f"playground {i + 1} of {panels.count()}", problems)


def _check_playground(page, panel, name: str, problems: Problems) -> None:
    panel.scroll_into_view_if_needed()
    missing = _missing_parts(panel, [("KV budget slider", PLAYGROUND_SLIDER), ("plots", PLAYGROUND_PLOTS),
                                     ("run button", "button.pagedlab-run")])
    if missing:
        problems.add(f"{name} rendered without its {', '.join(missing)}")
        return
    plots = panel.locator(PLAYGROUND_PLOTS).first
    if not image_loaded(page, plots):
        problems.add(f"{name}: the plots never loaded")
        return
    before = plots.screenshot()
    handle = panel.locator(PLAYGROUND_SLIDER).first
    value = handle.get_attribute("aria-valuenow")
    handle.focus()
    page.keyboard.press("ArrowLeft")
    if not wait_for(page, lambda: handle.get_attribute("aria-valuenow") != value, timeout=5):
        problems.add(f"{name}: the KV budget slider did not move (stuck at {value})")
        return
    status = panel.locator(".pagedlab-playground-status").first
    said = status.inner_text()
    panel.locator("button.pagedlab-run").first.click()
    # A run first says "running…", then "run N: ..." (or an error) once it has drawn: seconds on a busy machine.
    if not wait_for(page, lambda: status.inner_text() != said or plots.screenshot() != before, timeout=15):
        problems.add(f"{name}: moving the KV budget slider and pressing run did not change the plots "
                     "(nothing happened within 15 s)")
        return
    wait_for(page, lambda: "running" not in status.inner_text(), timeout=120, interval=1.0)
    if not wait_for(page, lambda: plots.screenshot() != before, timeout=5, interval=0.5):
        problems.add(f"{name}: moving the KV budget slider and pressing run did not change the plots "
                     f"(status: {status.inner_text()[:300]!r})")
