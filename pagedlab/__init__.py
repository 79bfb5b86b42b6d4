"""pagedlab: PagedAttention and continuous batching, built to be read, run and measured.

    from pagedlab import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)
"""

from pagedlab.config import EngineConfig
from pagedlab.engine import LLMEngine
from pagedlab.llm import LLM
from pagedlab.outputs import CompletionOutput, EngineStats, RequestOutput
from pagedlab.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
