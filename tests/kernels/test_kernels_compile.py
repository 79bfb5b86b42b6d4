"""Every Triton kernel compiled ahead of time for sm_80, sm_89 and sm_90 on this CPU: no GPU needed.

The interpreter tests (test_kernels.py) check the kernels' arithmetic; the GPU compiler checks what the
interpreter never does: `tl.dot` shapes, layouts, registers, shared memory. Over the grid of constexprs the
wrappers can choose (`pagedlab.kernels.aot_grid`), each variant must compile, spill no register to local
memory, fit the target's shared memory, and run its 16-bit `tl.dot` on tensor cores. The grid compiles in
fresh processes (the kernels here are in the interpreter's mode); with an empty Triton cache it takes about
2 minutes on 2 cores, a few seconds once cached (~/.triton/cache).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl

from pagedlab.kernels.aot import TARGETS, CompileReport, compile_for_target, pointer, problems
from pagedlab.kernels.aot_grid import KERNELS, Case, compile_grid, grid_cases, markdown_table, tile_cases

pytestmark = [
    pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION"),  # Triton 3.9's note on its default
    pytest.mark.slow,  # about two minutes with an empty Triton cache
]
README = Path(__file__).resolve().parents[2] / "README.md"
JOBS = max(1, min(len(os.sched_getaffinity(0)), 8))


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return compile_grid(grid_cases(), jobs=JOBS)


@pytest.mark.parametrize("kernel, arch", [(spec.id, arch) for spec in KERNELS for arch in spec.archs],
                         ids=[f"{spec.id}-sm_{arch}" for spec in KERNELS for arch in spec.archs])
def test_kernel_compiles_for_the_target(compiled, kernel, arch):
    results = [r for r in compiled if r["kernel"] == kernel and r["arch"] == arch]
    assert results, f"no variant of {kernel} compiled for sm_{arch}"
    failures = [f"{r['case']} -> {r['constants']}: {'; '.join(r['problems'])}\n{r['error'] or ''}"
                for r in results if r["problems"]]
    assert not failures, f"{len(failures)} of {len(results)} variants unfit for sm_{arch}:\n" + "\n".join(failures)


# Variants outside the grid that spilled on sm_80 (issue 31), with the constexprs their wrappers pick: ptxas stored
# a register before the key loop and reloaded it after, so as to stay at 64-80 (float32) or 128 (16-bit) registers
OFF_GRID = {
    "decode-float32-group4-dim96-block128-window": Case("paged_decode_kernel", 80, dict(
        dtype="float32", group=4, head_dim=96, block_size=128, window=True)),
    "prefill-float16-group7-dim128-block32-window": Case("paged_prefill_kernel", 80, dict(
        dtype="float16", group=7, head_dim=128, block_size=32, window=True)),
    "prefill-float32-group3-dim64-block16-window": Case("paged_prefill_kernel", 80, dict(
        dtype="float32", group=3, head_dim=64, block_size=16, window=True)),
}


@pytest.fixture(scope="module")
def off_grid() -> dict[str, dict]:
    return dict(zip(OFF_GRID, compile_grid(list(OFF_GRID.values()), jobs=JOBS)))


@pytest.mark.parametrize("name", OFF_GRID)
def test_variants_off_the_grid_fit_the_target(off_grid, name):
    result = off_grid[name]
    assert not result["problems"], f"{result['case']} -> {result['constants']}: {'; '.join(result['problems'])}"


def test_the_sweep_takes_every_tile_of_every_kernel_once_per_target():
    from pagedlab.kernels.aot_grid import tile

    cases = tile_cases()
    for spec in KERNELS:
        mine = [c for c in cases if c.kernel == spec.id]
        tiles = {tile(spec, dict(zip(spec.axes, combo))) for combo in itertools.product(*spec.axes.values())}
        for arch in spec.archs:
            swept = [tile(spec, c.values) for c in mine if c.arch == arch]
            assert sorted(swept) == sorted(tiles), (spec.id, arch)


def test_the_stored_sweep_is_this_trees_and_the_readme_says_what_it_found():
    """docs/kernels/tile_sweep.md (scripts/kernel_sweep.py, out of CI) compiled the cases tile_cases() gives now,
    and the README counts the variants it found unfit."""
    from pagedlab.kernels.aot_grid import cases_digest

    sweep = (README.parent / "docs" / "kernels" / "tile_sweep.md").read_text()
    assert f"Cases digest: `{cases_digest(tile_cases())}`" in sweep, "the tiles changed: run scripts/kernel_sweep.py"
    unfit = int(re.search(r"Unfit variants: (\d+)\.", sweep).group(1))
    assert len(re.findall(r"^- sm_\d+ ", sweep, re.M)) == unfit
    said = re.search(r"Its last run found (\S+) of its ([\d,]+) variants unfit", README.read_text())
    assert said, "the README does not say what the sweep found"
    assert said.group(1) == ("none" if unfit == 0 else str(unfit)) and said.group(2) == f"{len(tile_cases()):,}"


def test_grid_takes_every_value_for_every_kernel_and_target():
    cases = grid_cases()
    for spec in KERNELS:
        for arch in spec.archs:
            mine = [c.values for c in cases if c.kernel == spec.id and c.arch == arch]
            for axis, values in spec.axes.items():
                assert {case[axis] for case in mine} == set(values), (spec.id, arch, axis)
            for largest in spec.largest():  # the biggest tile of each dtype
                assert any(largest.items() <= case.items() for case in mine), (spec.id, arch, largest)


def test_readme_table_is_the_generated_one(compiled):
    """The README's kernel table is what scripts/kernel_table.py printed from this grid (with this Triton)."""
    text = README.read_text()
    found = re.search(r"<!-- kernel-table -->\n(.*?)<!-- /kernel-table -->", text, re.S)
    assert found, "README.md has no kernel table (python scripts/kernel_table.py --write-readme)"
    version = re.search(r"triton (\S+)", found.group(1))
    import triton

    if version is None or version.group(1) != triton.__version__:
        pytest.skip(f"the README's table was made with another Triton than {triton.__version__}: regenerate it")
    assert found.group(1) == markdown_table(compiled), "regenerate it: python scripts/kernel_table.py --write-readme"


# -- what the interpreter runs and the GPU compiler rejects ----------------------------------------------------


def dot_with_k8(a_ptr, b_ptr, out_ptr, K: tl.constexpr):
    """[16, K] x [K, 16]: with K = 8 (a head dim of 8 left unpadded) the interpreter multiplies it, but a GPU's
    tensor cores take K >= 16, so Triton refuses to compile it. This is why the wrappers pad BLOCK_D to >= 16."""
    rows = tl.arange(0, 16)
    ks = tl.arange(0, K)
    a = tl.load(a_ptr + rows[:, None] * K + ks[None, :])
    b = tl.load(b_ptr + ks[:, None] * 16 + rows[None, :])
    tl.store(out_ptr + rows[:, None] * 16 + rows[None, :], tl.dot(a, b))


def compile_demos() -> dict:
    """Run in a fresh process (kernels in compiled mode: in this one, the interpreter tests may have patched
    triton.language): dot_with_k8 for each target, with K = 8 and K = 16, and a store_kv variant the wrapper
    never picks, one warp for 64 KV heads x 256 dims."""
    from triton.runtime.jit import JITFunction

    from pagedlab.kernels.store_kv import store_kv_constants, store_kv_kernel

    args = dict(a_ptr=pointer(torch.float16), b_ptr=pointer(torch.float16), out_ptr=pointer(torch.float32))
    rejected = {}
    for arch in TARGETS:
        try:
            compile_for_target(JITFunction(dot_with_k8), args, dict(K=8), arch)
            rejected[arch] = None
        except Exception as error:
            rejected[arch] = f"{type(error).__name__}: {error}"
    padded = compile_for_target(JITFunction(dot_with_k8), args, dict(K=16), 90)
    f32 = pointer(torch.float32)
    args = dict(key_ptr=f32, value_ptr=f32, key_cache_ptr=f32, value_cache_ptr=f32,
                slot_mapping_ptr=pointer(torch.int64), key_stride_token=64 * 256, key_stride_head=256,
                value_stride_token=64 * 256, value_stride_head=256)
    spilling = compile_for_target(store_kv_kernel, args, {**store_kv_constants(64, 256), "num_warps": 1}, 80)
    return dict(rejected=rejected, padded=vars(padded), spilling=vars(spilling))


@pytest.fixture(scope="module")
def demos() -> dict:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    code = "import json, tests.kernels.test_kernels_compile as t; print(json.dumps(t.compile_demos()))"
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=README.parent, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_the_compiler_rejects_what_the_interpreter_runs(demos):
    from triton.runtime.interpreter import InterpretedFunction

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(16, 8, generator=generator).half()
    b = torch.randn(8, 16, generator=generator).half()
    out = torch.empty(16, 16)
    InterpretedFunction(dot_with_k8)[(1,)](a, b, out, K=8)
    torch.testing.assert_close(out, a.float() @ b.float())  # the interpreter: fine

    for arch, error in demos["rejected"].items():  # the GPU compiler: no
        assert error and error.startswith("CompilationError") and "K >= 16" in error, (arch, error)
    padded = CompileReport(**demos["padded"])  # K = 16, as the wrappers pad it
    assert padded.tensor_cores and not problems(padded, needs_tensor_cores=True)


def test_a_spilling_variant_is_reported(demos):
    """The spill shows in the cubin's local memory (not in the PTX), and `problems` names it."""
    spilling = CompileReport(**demos["spilling"])
    assert spilling.local_bytes > 0 and not spilling.ptx_local
    assert any(p.startswith("spills") for p in problems(spilling, needs_tensor_cores=False))


def test_problems_names_each_limit():
    fit = CompileReport("k", 89, shared=99 * 1024, num_warps=4, num_stages=3, registers=255, local_bytes=0,
                        ptx_local=False, tensor_cores="mma", seconds=0.0)
    assert problems(fit, needs_tensor_cores=True) == []
    too_big = CompileReport(**{**vars(fit), "shared": 99 * 1024 + 1, "tensor_cores": ""})
    found = problems(too_big, needs_tensor_cores=True)
    assert "needs 101377 bytes of shared memory, sm_89 (L4, RTX 4090) has 101376" in found[0]
    assert "tensor-core" in found[1]
