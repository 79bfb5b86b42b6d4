"""Run a notebook the way a reader does: in JupyterLab, in a real browser, with "Run All Cells".

`JupyterLab` starts a throwaway server (free loopback port, random token, settings and runtime files in a
temp dir) and always stops it, kernels included. `run_all_cells` opens one notebook in headless Chromium,
runs it from the Run menu and returns the notebook's state once the kernel is done (checks.py judges it).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM_ENV = "PAGEDLAB_CHROMIUM"  # path of the Chromium executable; default: `chromium` on PATH
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
HOW_TO_ENABLE = (
    "the browser test needs Chromium and Playwright: `apt-get install chromium` (or set "
    f"{CHROMIUM_ENV}=/path/to/chromium) and `pip install -e '.[dev]'`, then `make test-browser`"
)

# User settings for the throwaway server: every cell in the DOM (the default windowing leaves off-screen
# cells out), nothing saved back to disk, no news or update checks (no network here, and no toasts).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


START_ATTEMPTS = 3  # each with a port of its own


class _PortTaken(RuntimeError):
    pass


def find_chromium() -> str | None:
    """The Chromium executable to drive, or None where there is none (the browser test then skips)."""
    path = os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or shutil.which("chromium-browser")
    return path if path and os.access(path, os.X_OK) else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class JupyterLab:
    """A JupyterLab server serving `root_dir`, for one `with` block. Kernels and server stop on exit.

    Everything it writes (runtime files, connection files, settings, workspaces, its log) lives in a temp
    dir, so it neither reads nor changes the user's own Jupyter set-up.
    """

    def __init__(self, root_dir: Path, startup_timeout: float = 90.0):
        self.root_dir = Path(root_dir)
        self.startup_timeout = startup_timeout
        self.port = 0  # picked on start
        self.token = secrets.token_hex(16)
        self._tmp = Path(tempfile.mkdtemp(prefix="pagedlab-lab-"))
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> JupyterLab:
        settings_dir = self._tmp / "settings"
        for plugin, values in LAB_SETTINGS.items():
            path = settings_dir / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = {
            **os.environ,
            "JUPYTER_RUNTIME_DIR": str(self._tmp / "runtime"),
            "JUPYTER_CONFIG_DIR": str(self._tmp / "config"),
            "JUPYTER_DATA_DIR": str(self._tmp / "data"),  # kernels and lab extensions: this Python's own
            "JUPYTERLAB_SETTINGS_DIR": str(settings_dir),
            "JUPYTERLAB_WORKSPACES_DIR": str(self._tmp / "workspaces"),
        }
        self.log_path = self._tmp / "server.log"
        try:
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    self._start(env)
                    return self
                except _PortTaken:
                    if attempt == START_ATTEMPTS:
                        raise
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start(self, env: dict[str, str]) -> None:
        # A port free when picked may be bound by someone else (a kernel, a test's server) before the server
        # binds it; the server then exits, and __enter__ tries again with another.
        self.port = free_port()
        command = [
            sys.executable, "-m", "jupyterlab", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root_dir}",
            "--ServerApp.terminals_enabled=False",
            "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: read the notebook model, not pixels
        ]
        if os.geteuid() == 0:  # CI containers run as root; the server refuses that unless told
            command.append("--allow-root")
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group, so that stopping it cannot miss a child
            )
        self._wait_until_up()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def api(self, method: str, path: str) -> object:
        request = urllib.request.Request(
            self.url + path, method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if f"port {self.port} is not available" in self.server_log():
                    raise _PortTaken(f"port {self.port} was taken before JupyterLab could bind it")
                raise RuntimeError(f"JupyterLab exited with {self._proc.returncode}:\n{self.server_log()}")
            try:
                self.api("GET", "/api/status")
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer within {self.startup_timeout:.0f}s:\n{self.server_log()}")

    def server_log(self, last: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-last:]

    def shutdown_kernels(self) -> None:
        """Shut down every session and kernel: each notebook gets a fresh one, and memory stays low."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")

    def stop(self) -> None:
        """Ask the server to shut down (it stops its kernels), then signal what is left, by process id."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                self.api("POST", "/api/shutdown")
                self._proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(self._proc.pid, sig)
                        self._proc.wait(timeout=10)
                        break
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        pass
        # Kernels run in process groups of their own; any that outlived the server still name one of our
        # connection files on their command line.
        for pid in _pids_whose_command_line_contains(str(self._tmp)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self._tmp, ignore_errors=True)


def _pids_whose_command_line_contains(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if text.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            pass
    return [pid for pid in pids if pid != os.getpid()]


# Read from the notebook model (window.jupyterapp), not from pixels: kernel status and, per code cell,
# execution state and count, and each output's type, MIME types and error text; for the cells marked
# `# NBVAL_CHECK_OUTPUT`, each output's text too (streams by name, text/* data by MIME type).
_NOTEBOOK_STATE_JS = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!panel || !panel.sessionContext || !panel.content || !panel.content.model) return null;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = [];
  const model = panel.content.model;
  for (let i = 0; i < model.cells.length; i++) {
    const cell = model.cells.get(i);
    if (cell.type !== 'code') continue;
    const outputs = [];
    const source = cell.sharedModel.getSource();
    const checked = source.includes('NBVAL_CHECK_OUTPUT');  // its text is compared with the stored outputs
    for (let j = 0; j < cell.outputs.length; j++) {
      const out = cell.outputs.get(j).toJSON();
      const text = {};
      if (checked && !(out.data && out.data['application/vnd.jupyter.widget-view+json'])) {  // not progress bars
        if (out.output_type === 'stream') text[out.name] = out.text;
        for (const [mime, value] of Object.entries(out.data || {})) {
          if (mime.startsWith('text/')) text[mime] = Array.isArray(value) ? value.join('') : value;
        }
      }
      outputs.push({type: out.output_type, mimes: Object.keys(out.data || {}), ename: out.ename || null,
                    evalue: out.evalue || null, traceback: (out.traceback || []).join('\\n'), text});
    }
    cells.push({index: i, count: cell.executionCount, state: cell.executionState, outputs, checked,
                empty: source.trim() === ''});
  }
  return {kernel: kernel ? kernel.status : null, cells};
}"""

def wait_for(page, predicate, timeout: float, interval: float = 0.25):
    """Poll `predicate()` until it returns something truthy; return that, or None on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        page.wait_for_timeout(interval * 1000)


def run_all_cells(page, lab: JupyterLab, notebook: str, timeout: float) -> dict:
    """Open `notebook` (a path under the server's root), Run > Run All Cells, wait for the kernel to finish.

    Returns the final notebook state (see `_NOTEBOOK_STATE_JS`); raises TimeoutError if it never settles.
    """
    # A workspace of its own, reset: else JupyterLab reopens the notebooks of earlier pages, kernels and all.
    workspace = "".join(c if c.isalnum() else "-" for c in notebook)
    page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/{notebook}?reset&token={lab.token}")
    state = lambda: page.evaluate(_NOTEBOOK_STATE_JS)  # noqa: E731
    if not wait_for(page, lambda: (s := state()) and s["kernel"] == "idle", timeout=60):
        raise TimeoutError(f"{notebook}: the kernel did not start within 60s")
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # more notebook in the screenshot
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    # Done when every cell ran (or one failed), no cell is queued or running and the kernel is idle, twice
    # in a row (a cell's widget messages can keep the kernel busy for a moment after its execute reply).
    settled, s = 0, state()
    deadline = time.monotonic() + timeout
    while settled < 2:
        if time.monotonic() > deadline:
            running = [cell["index"] for cell in s["cells"] if cell["state"] == "running"]
            unrun = [cell["index"] for cell in s["cells"] if cell["count"] is None and not cell["empty"]]
            raise TimeoutError(
                f"{notebook}: Run All Cells did not finish within {timeout:.0f}s "
                f"(kernel {s['kernel']}, cells running or queued: {running}, not run: {unrun})"
            )
        page.wait_for_timeout(500)
        s = state()
        busy = s["kernel"] != "idle" or any(cell["state"] == "running" for cell in s["cells"])
        stopped = all(cell["count"] is not None or cell["empty"] for cell in s["cells"]) or any(
            out["type"] == "error" for cell in s["cells"] for out in cell["outputs"]
        )  # Run All stops at the first error and leaves the cells after it unrun
        settled = settled + 1 if stopped and not busy else 0
    return s
