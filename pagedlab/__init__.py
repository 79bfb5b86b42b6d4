"""pagedlab: PagedAttention and continuous batching, built to be read, run and measured.

    from pagedlab import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)

The names below are imported on first use, so that `import pagedlab.core` (the pure-Python block manager
and scheduler) does not pay for torch and transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedlab.llm",
    "LLMEngine": "pagedlab.engine",
    "EngineConfig": "pagedlab.config",
    "SamplingParams": "pagedlab.sampling_params",
    "RequestOutputKind": "pagedlab.sampling_params",
    "RequestOutput": "pagedlab.outputs",
    "CompletionOutput": "pagedlab.outputs",
    "EngineStats": "pagedlab.outputs",
    "BeamSearchParams": "pagedlab.sampling_params",
    "BeamSearchOutput": "pagedlab.beam_search",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
