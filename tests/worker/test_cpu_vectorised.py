"""The C++ CPU kernels' exp (`exp_approx`, csrc/cpu_vector.h) is only worth having inside loops the compiler turns
into vector code: the SiLU's scalar loop (a union in its exp kept gcc from vectorising it) ran 10x slower than torch's
SiLU and multiply, and the prefill kernel's softmax loops stop vectorising when the exp takes branchy clamps. gcc
reports each loop it vectorised; every loop that calls the exp must be one of them."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sysconfig

import pytest

from pagedlab.worker import cpu_attention

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
                                reason="gcc's vectorisation report, on x86")


@pytest.mark.parametrize("source", [cpu_attention.SOURCE, cpu_attention.FUSED_SOURCE, cpu_attention.PREFILL_SOURCE],
                         ids=lambda path: path.name)
def test_every_loop_that_calls_the_exp_compiles_to_vector_code(source):
    from torch.utils import cpp_extension

    lines = source.read_text().splitlines()
    calls = [number for number, line in enumerate(lines, 1) if "exp_approx(" in line and "using" not in line]
    assert calls, f"{source.name} calls no exp_approx"
    includes = [f"-I{path}" for path in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    report = subprocess.run(
        ["g++", "-std=c++17", *cpu_attention.compiler_flags(), *includes, "-fopt-info-vec-optimized", "-c",
         str(source), "-o", os.devnull], capture_output=True, text=True, check=True).stderr
    pattern = rf"{re.escape(source.name)}:(\d+):\d+: optimized: loop vectorized"
    vectorised = {int(m) for m in re.findall(pattern, report)}
    for call in calls:  # gcc names a loop by its `for` line or by a line of its body
        loop = next(number for number in range(call, 0, -1) if re.match(r"\s*for \(", lines[number - 1]))
        assert set(range(loop, call + 1)) & vectorised, \
            f"the loop at {source.name}:{loop} is not vectorised: {sorted(vectorised)}"
