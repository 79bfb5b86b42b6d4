"""`LLM`: the offline API of vLLM, on pagedlab's engine.

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(outputs[0].outputs[0].text)

`generate` queues every prompt, steps the engine until all have finished, and returns the outputs in the
order of the prompts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from pagedlab.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, length_normalized
from pagedlab.engine import LLMEngine
from pagedlab.inputs import PromptType
from pagedlab.outputs import EngineStats, RequestOutput
from pagedlab.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """An engine with a model, for batch generation.

    model: "smollm2-135m-instruct" (the default, embedded), a local folder or Hub id of a transformers causal
        LM, or a `transformers.PreTrainedModel` object (then pass `tokenizer` too if you want text prompts).
    dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16" or "float16".
    device: "auto", "cpu" or "cuda".
    Everything else is an `EngineConfig` field: block_size, num_kv_blocks, kv_cache_memory,
    gpu_memory_utilization, max_num_seqs, max_num_batched_tokens, max_model_len, seed, record_trace, ...
    """

    def __init__(self, model=None, tokenizer=None, *, dtype="auto", device="auto", **engine_config) -> None:
        self.llm_engine = LLMEngine.from_pretrained(model, tokenizer, dtype=dtype, device=device, **engine_config)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def close(self) -> None:
        """Stop the worker processes of `tensor_parallel_size > 1` (also done on garbage collection and at exit)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one `SamplingParams` for all, or one per prompt.

        A prompt plus `max_tokens` beyond `max_model_len` is not refused: its output stops at max_model_len, with
        finish_reason "length" (`pagedlab serve` refuses such a request with a 400, as vLLM's server does)."""
        prompts = _as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} SamplingParams")
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                request_ids.append(engine.add_request(None, prompt, params))
        except Exception:
            engine.abort_request(request_ids)  # a bad prompt: none of this call's requests stay behind
            raise
        return self._run(request_ids, use_tqdm)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's API shape), run inside the engine; best sequence first."""
        prompts = _as_list(prompts)
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for prompt in prompts:
                request_ids.append(engine.add_beam_request(None, prompt, params))
        except Exception:
            engine.abort_request(request_ids)
            raise
        return [BeamSearchOutput([_beam_sequence(output, c, params) for c in output.outputs])
                for output in self._run(request_ids, use_tqdm)]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat() needs a tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": _token_ids(
                tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)),
             "prompt": tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=False)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stats(self) -> EngineStats:
        return self.llm_engine.stats()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        start, generated_before = time.perf_counter(), engine.stats().num_generated_tokens
        try:
            while len(done) < len(wanted):
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        done[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    generated = engine.stats().num_generated_tokens - generated_before
                    bar.set_postfix_str(f"{generated / max(time.perf_counter() - start, 1e-9):.1f} tok/s out")
        except BaseException:
            engine.abort_request([rid for rid in request_ids if rid not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in request_ids]


def _beam_sequence(output: RequestOutput, c, params: BeamSearchParams) -> BeamSearchSequence:
    """One hypothesis of a finished beam search (or its error, when the request failed)."""
    if c.finish_reason == "error":
        return BeamSearchSequence(list(output.prompt_token_ids), "", None, None, "error", c.error)
    score = length_normalized(c.cumulative_logprob, len(c.token_ids), params.length_penalty)
    return BeamSearchSequence(output.prompt_token_ids + c.token_ids, c.text, c.cumulative_logprob, score,
                              c.finish_reason)


def _as_list(prompts) -> list:
    """One prompt (text, token ids or a dict) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _token_ids(encoded) -> list[int]:
    """`apply_chat_template(tokenize=True)` returns a list in some versions and a BatchEncoding in others."""
    if isinstance(encoded, list):
        return encoded
    return list(encoded["input_ids"])
