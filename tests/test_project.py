"""The project's promises outside the engine: packaging, the environment file, the command line."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _names(requirements) -> set[str]:
    names = set()
    for line in requirements:
        if line.startswith("-e") or line.startswith("#"):
            continue
        names.add(re.split(r"[<>=!~;\s\[]", line.strip(), maxsplit=1)[0].lower())
    return names


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(pyproject["dependencies"])
    for extra in ("lab", "test"):
        wanted |= set(pyproject["optional-dependencies"][extra])
    pip_lines = []
    in_pip = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if line.strip() == "- pip:":
            in_pip = True
            continue
        if in_pip and line.strip().startswith("- "):
            pip_lines.append(line.strip()[2:])
    assert _names(pip_lines) == _names(wanted)
    assert "python=3.11" in (ROOT / "environment.yml").read_text()
    # and the same version bounds, line for line
    assert {line for line in pip_lines if not line.startswith("-e")} == wanted


def test_kernels_install_inside_the_package_not_as_top_level_kernels(tmp_path):
    """Outside the repo (so that the working directory is not on sys.path) `kernels` is not ours."""
    import subprocess

    code = (
        "import importlib.util as u; s = u.find_spec('kernels'); "
        "print(u.find_spec('pagedlab.kernels').origin); print(s.origin if s else None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    ours, top_level = out.stdout.split()
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    assert top_level == "None" or Path(top_level).parent != ROOT / "kernels"


def test_core_imports_no_torch():
    import subprocess

    code = "import sys, pagedlab.core.scheduler, pagedlab.core.trace, pagedlab.contiguous; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_generate_answers_from_the_embedded_model(smollm2, capsys):
    from pagedlab.cli import main

    assert main(["generate", "What is the capital of France?", "--max-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "The capital of France is Paris."
    assert re.search(r"KV blocks: peak \d+ of \d+ used, 16 tokens each", captured.err)


def test_cli_reports_bad_arguments(capsys):
    from pagedlab.cli import main

    assert main(["generate", "hi", "--block-size", "3", "--model", "smollm2-135m-instruct"]) == 2
    assert "block_size must be a power of two" in capsys.readouterr().err


def test_python_dash_m_pagedlab_help():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "pagedlab", "--help"], capture_output=True, text=True, check=True)
    assert "generate" in out.stdout


def test_embedded_weights_are_converted_once(smollm2, monkeypatch):
    from pagedlab import models

    first = models.embedded_model_dir()
    monkeypatch.setattr(models, "embedded_gguf_dir", lambda: pytest.fail("converted again"))
    assert models.embedded_model_dir() == first and (first / "model.safetensors").exists()
