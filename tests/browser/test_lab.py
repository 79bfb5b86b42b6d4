"""The throwaway JupyterLab server itself: it starts even when the port it picked is taken by then."""

from __future__ import annotations

import importlib.util
import socket

import pytest

from . import lab as lab_module
from .lab import JupyterLab

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jupyterlab") is None, reason="JupyterLab not installed")


def test_the_server_starts_when_its_port_is_taken_before_it_binds(tmp_path, monkeypatch):
    # free_port() only finds a port that is free *now*; another process (a kernel, a test's server) can bind
    # it before JupyterLab does. Make that happen every first time: the picked port is one held open here.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        real_free_port = lab_module.free_port
        picks = iter([taken_port])
        monkeypatch.setattr(lab_module, "free_port", lambda: next(picks, None) or real_free_port())

        with JupyterLab(tmp_path) as server:
            assert server.port != taken_port
            assert server.api("GET", "/api/status") is not None
