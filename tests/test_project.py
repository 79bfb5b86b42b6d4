"""The project's promises outside the engine: packaging, the environment file, the command line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

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


def test_transformers_imports_from_the_repository_root():
    """From the checkout's root (the working directory of `make install`'s steps, of pytest and of a user's `python`)
    the folder kernels/ comes first on sys.path as a top-level `kernels`. transformers 5.25 requires Hugging Face's
    `kernels` package and imports it at `import transformers.activations`, which found ours and failed (a fresh
    `make install` stopped there): pyproject admits only the transformers releases that do not."""
    code = "import transformers.activations, transformers.models.llama.modeling_llama"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1]


def test_core_imports_no_torch():
    import subprocess

    code = (
        "import sys, pagedlab.core.scheduler, pagedlab.core.trace, pagedlab.core.draft_tables, pagedlab.contiguous, "
        "pagedlab.spec_decode.ngram_proposer; print('torch' in sys.modules)"
    )
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


def test_test_fast_filters_markers_that_exist_and_are_used():
    """`make test-fast` deselects markers: each must be declared (pytest --strict-markers) and put on tests."""
    makefile = (ROOT / "Makefile").read_text()
    expression = re.search(r'test-fast:.*?-m "([^"]+)"', makefile, re.S).group(1)
    names = set(re.findall(r"\b(?!not\b|and\b|or\b)(\w+)", expression))
    declared = {line.split(":")[0].strip().strip('"') for line in tomllib.loads(
        (ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    sources = "".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    for name in names:
        assert name in declared, f"marker {name!r} is not declared in pyproject.toml"
        assert f"mark.{name}" in sources, f"no test is marked {name!r}: test-fast filters nothing"


def test_make_lab_starts_jupyterlab_on_the_chapters(tmp_path):
    """The README's first command, as a user runs it (as root too, as in containers), with no browser."""
    import json
    import os
    import shutil
    import signal
    import socket
    import subprocess
    import time
    import urllib.request

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "pagedlab-test"
    args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token} --ServerApp.port_retries=0"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    process = subprocess.Popen(
        ["make", "--no-print-directory", "lab", f"LAB_ARGS={args}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        listing = None
        for _ in range(120):
            time.sleep(0.5)
            assert process.poll() is None, process.stdout.read().decode()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}", timeout=5) as r:
                    listing = json.load(r)
                break
            except OSError:
                continue
        assert listing is not None, "JupyterLab did not answer within a minute"
        names = {item["name"] for item in listing["content"]}
        chapters = {p.name for p in (ROOT / "chapters").glob("*.ipynb")}
        assert chapters and chapters <= names, f"the lab shows {sorted(names)}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


# What a user gets from `pip install pagedlab`: the wheel, not the source tree (an editable install hides what the
# wheel leaves out). Its code imports every module and runs one generate and one simulation from the wheel.
WHEEL_CHECK = """
import pathlib, pkgutil, sys, importlib
import pagedlab
assert "site-packages" in pagedlab.__file__, pagedlab.__file__  # the wheel, never the checkout
names = [m.name for m in pkgutil.walk_packages(pagedlab.__path__, "pagedlab.")]
names.remove("pagedlab.__main__")  # runs the command line
for name in names:
    importlib.import_module(name)
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from pagedlab import LLM, SamplingParams
from pagedlab.sim import Lengths, make_workload, simulate
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)).eval()
model.config.eos_token_id = model.generation_config.eos_token_id = None
llm = LLM(model, num_kv_blocks=16, block_size=4)
out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
workload = make_workload(4, prompt_len=Lengths("fixed", 8), output_len=Lengths("fixed", 4))
trace = simulate(workload, num_kv_blocks=32, block_size=4)
from pagedlab.worker import cpu_attention
assert cpu_attention.SOURCE.exists() and cpu_attention.kernel() is not None, cpu_attention.load().error
print(len(names), len(out[0].outputs[0].token_ids), len(trace))
"""


@pytest.mark.slow
def test_a_wheel_installed_in_a_fresh_venv_imports_everything_and_runs(tmp_path):
    """Build the wheel (no build isolation: no network), install it into a new virtual environment that borrows
    this one's dependencies (a .pth line, so that only pagedlab comes from the wheel), and run from there."""
    import shutil
    import subprocess
    import sysconfig
    import venv

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "pagedlab", "kernels"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", source],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("pagedlab-*.whl"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], check=True)
    # A home of its own; the C++ kernel's build cache is shared (its name hashes the source text, so the wheel's copy
    # of the source loads the build the checkout made instead of compiling for a minute).
    from pagedlab.worker import cpu_attention

    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TRITON_INTERPRET": "1",
           "PAGEDLAB_CACHE": str(cpu_attention.CACHE_DIR.parent)}
    run = subprocess.run([python, "-c", WHEEL_CHECK], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    num_modules, num_tokens, num_steps = map(int, run.stdout.split())
    assert num_modules > 50 and num_tokens == 4 and num_steps > 0


def test_no_chapter_stores_an_error_output():
    """A stored traceback is a chapter that failed when it was last run (the run itself is checked elsewhere)."""
    import json

    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            errors = [out for out in cell.get("outputs", []) if out["output_type"] == "error"]
            assert not errors, f"{path.name} cell {index} stores {errors[0]['ename']}: {errors[0]['evalue']}"


def test_processes_starting_together_convert_the_embedded_model_once(tmp_path):
    """Three processes ask for the embedded model's folder at once (chapters and test workers do, on a fresh
    machine): one converts it, the others wait for it, and none deletes a folder another is reading."""
    script = textwrap.dedent("""
        import sys, time
        import pagedlab.models as models

        def convert(target):  # stands in for the minute-long GGUF conversion
            time.sleep(1.0)
            target.mkdir(parents=True)
            (target / "config.json").write_text("{}")
            (target / "model.safetensors").write_text("")
            with open(sys.argv[1], "a") as log:
                log.write("converted\\n")

        models._convert_embedded = convert
        print(models.embedded_model_dir())
    """)
    log = tmp_path / "conversions.log"
    env = {**os.environ, "PAGEDLAB_CACHE": str(tmp_path / "cache")}
    processes = [subprocess.Popen([sys.executable, "-c", script, str(log)], env=env, stdout=subprocess.PIPE, text=True)
                 for _ in range(3)]
    outputs = [p.communicate(timeout=120)[0] for p in processes]
    assert all(p.returncode == 0 for p in processes), outputs
    assert log.read_text().count("converted") == 1


def test_gpu_check_runs_test_files_that_exist():
    """`make gpu-check` runs on a GPU no session may have: the tests it points pytest at must at least exist."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.KERNEL_TESTS.is_file(), gpu_check.KERNEL_TESTS


def test_gpu_check_compiled_step_runs_a_script_that_takes_its_arguments():
    """Step 4 of `make gpu-check` runs scripts/compile_lever.py on the GPU: the script must take the arguments it
    is given there."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_lever.py"), "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for option in ("--device {cpu,cuda}", "--dtype {float32,bfloat16}", "--rounds"):
        assert option in result.stdout, option
