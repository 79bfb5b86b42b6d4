"""Compile a Triton kernel ahead of time for a real NVIDIA GPU, on any Linux machine: no GPU needed.

    compile_for_target(kernel, args, constants, arch) -> CompileReport     (raises if the compiler rejects it)
    problems(report, needs_tensor_cores) -> list of what would go wrong on that GPU

Triton's wheel carries its CUDA backend and `ptxas`, so `triton.compile(ASTSource(...), target=GPUTarget(...))`
lowers a kernel to PTX and a cubin on a CPU. The arguments are specialised as a launch would specialise them
(Triton's own binder: pointer dtypes, integers divisible by 16), and the cubin's registers and local memory
(spills) are read with the wheel's `cuobjdump`. Triton's interpreter runs the same kernels on a CPU but checks
far less (`tl.dot` shapes, layouts, registers, shared memory): this is what a GPU would reject or struggle with.
Needs kernels in compiled mode, i.e. TRITON_INTERPRET unset when triton is imported; `aot_grid` runs the
compilations in fresh processes for that.

# The kernels are explained in chapters/03_paged_attention.ipynb; compiling them ahead of time is in no chapter.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, MockTensor, create_function_from_signature

# arch -> (GPUs, the most shared memory one program may use in bytes: cudaDevAttrMaxSharedMemoryPerBlockOptin,
# from the CUDA C++ Programming Guide's table of compute capabilities)
TARGETS = {
    80: ("A100", 163 * 1024),
    89: ("L4, RTX 4090", 99 * 1024),
    90: ("H100, H200", 227 * 1024),
}
MAX_REGISTERS = 255  # per thread, every target: beyond it ptxas spills to local memory


@dataclass(frozen=True)
class CompileReport:
    kernel: str
    arch: int
    shared: int  # bytes of shared memory per program (what Triton's launcher checks against the device)
    num_warps: int
    num_stages: int
    registers: int  # per thread, from the cubin
    local_bytes: int  # per thread, from the cubin: stack frame + local memory, i.e. spilled registers
    ptx_local: bool  # the PTX declares .local memory
    tensor_cores: str  # the tensor-core instruction in the PTX: "wgmma" (sm_90), "mma" (mma.sync) or ""
    seconds: float  # wall time of the compilation (0 when Triton's cache had it)


def pointer(dtype: torch.dtype) -> MockTensor:
    """A stand-in for a tensor argument: only its dtype (and a 16-byte aligned address) matter to the compiler."""
    return MockTensor(dtype, (1,))


def compile_for_target(kernel: JITFunction, args: dict, constants: dict, arch: int) -> CompileReport:
    """Compile `kernel` for sm_<arch>: `args` maps every runtime parameter to a representative value (a
    `pointer(dtype)` for a tensor, an int or float), `constants` every constexpr (launch options such as
    num_warps may ride along, as in a launch). Raises `triton.compiler.errors.CompilationError` (or the
    backend's error) when the GPU compiler rejects the kernel."""
    if not isinstance(kernel, JITFunction):
        raise TypeError(
            f"{kernel!r} is not a compiled-mode Triton kernel (TRITON_INTERPRET was set when triton was imported?)"
        )
    if arch not in TARGETS:
        raise ValueError(f"unknown target sm_{arch}: expected one of {sorted(TARGETS)}")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    # As JITFunction.run does on a launch: bind, specialise, split the constexprs off the options.
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    launch_kwargs = {**args, **constants}
    bound, specialization, options = binder(**launch_kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch_kwargs, bound, specialization, options)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    seconds = time.perf_counter() - start
    ptx = compiled.asm["ptx"]
    registers, local_bytes = _resource_usage(compiled.asm["cubin"])
    return CompileReport(
        kernel=kernel.__name__, arch=arch, shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
        num_stages=compiled.metadata.num_stages, registers=registers, local_bytes=local_bytes,
        ptx_local=re.search(r"\.local\b", ptx) is not None,
        tensor_cores="wgmma" if "wgmma.mma_async" in ptx else "mma" if "mma.sync" in ptx else "",
        seconds=round(seconds, 2),
    )


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack + local bytes) per thread of the cubin's one function, as `cuobjdump` reports them."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as file:
            file.write(cubin)
        command = [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path]
        text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text.split("Function", 1)[-1]))
    if set(usage) != {"REG", "STACK", "LOCAL"}:
        raise RuntimeError(f"cannot read the resource usage from cuobjdump's output:\n{text}")
    return int(usage["REG"]), int(usage["STACK"]) + int(usage["LOCAL"])


def problems(report: CompileReport, needs_tensor_cores: bool) -> list[str]:
    """What would go wrong, or run badly, on the target: empty when the kernel is fit for it."""
    gpus, max_shared = TARGETS[report.arch]
    found = []
    if report.shared > max_shared:
        found.append(f"needs {report.shared} bytes of shared memory, sm_{report.arch} ({gpus}) has {max_shared}")
    if report.local_bytes or report.ptx_local:
        found.append(f"spills: {report.local_bytes} bytes of local memory per thread ({report.registers} registers)")
    if needs_tensor_cores and not report.tensor_cores:
        found.append("its 16-bit tl.dot does not use tensor-core instructions (no mma / wgmma in the PTX)")
    return found
