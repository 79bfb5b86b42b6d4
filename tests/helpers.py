"""What the tests share: tiny random models of each supported family, random prompts, Hugging Face's greedy
reference, a driver that checks invariants every step, a byte tokenizer for text on tiny models (and one with a chat
template, for a tiny server), and a fake engine for the async frontend. Fixtures and hooks live in conftest.py."""

from __future__ import annotations

import threading
import time

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pagedlab.outputs import CompletionOutput, EngineStats, RequestOutput
from pagedlab.sampling_params import RequestOutputKind

# At the default init (std 0.02) the top logits of a random model nearly tie and greedy equality flakes;
# std 0.1 keeps the top-2 gap well above float noise.
TINY_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
)

TINY_FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**TINY_CONFIG)),
    # 6 query heads over 2 KV heads and a head_dim of 80 (not a power of two)
    "llama-gqa3-hd80": lambda: LlamaForCausalLM(
        LlamaConfig(**{**TINY_CONFIG, "hidden_size": 96, "num_attention_heads": 6, "head_dim": 80})
    ),
    "mistral-window8": lambda: MistralForCausalLM(MistralConfig(**TINY_CONFIG, sliding_window=8)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**TINY_CONFIG, head_dim=16)),
}


def tiny_model(family: str = "llama", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = TINY_FAMILIES[family]()
    model.config.eos_token_id = model.generation_config.eos_token_id = None  # run to max_tokens
    return model.eval()


def random_prompts(lengths, vocab_size=128, seed=1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face `generate(do_sample=False)`, one prompt at a time (no padding), new tokens only."""
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),  # else HF masks prompt tokens equal to the pad id
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        tokens = out[0, len(prompt) :].tolist()
        eos = model.generation_config.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        for i, token in enumerate(tokens):  # HF pads after EOS; pagedlab stops there
            if token in eos:
                tokens = tokens[: i + 1]
                break
        outputs.append(tokens)
    return outputs


def run_engine(engine, prompts: list[list[int]], max_tokens: int, mode: str = "all-at-once") -> list[list[int]]:
    """Drive the step-level engine; return each prompt's generated tokens. Checks invariants every step."""
    from pagedlab import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))

    def add(i: int, prompt: list[int]) -> None:
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)

    def step() -> None:
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()

    if mode == "all-at-once":
        for i, prompt in pending:
            add(i, prompt)
    step_index = 0
    while pending or engine.has_unfinished_requests():
        if mode == "one-at-a-time" and not engine.has_unfinished_requests():
            add(*pending.pop(0))
        elif mode == "staggered" and pending and step_index % 3 == 0:
            add(*pending.pop(0))  # a new request joins every third step, into a running batch
        elif mode == "all-at-once":
            pending.clear()
        step()
        step_index += 1
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks, "blocks leaked"
    return [results[f"r{i}"] for i in range(len(prompts))]


class ByteTokenizer:
    """A stand-in tokenizer for the tiny models: each token id is a few bytes of UTF-8, some of them only part of
    a character (as in byte-level BPE), so that text, stop strings and streaming can be tested on a tiny model.

    Ids 0-95 are the printable ASCII characters; 96-111 are halves and thirds of multi-byte characters ("é", "日",
    "🙂"); 112-127 are whole multi-byte characters. Decoding joins the bytes and replaces an incomplete character
    with U+FFFD, as Hugging Face tokenizers do."""

    eos_token_id = None
    chat_template = None

    def __init__(self, vocab_size: int = 128) -> None:
        partial = [b"\xc3", b"\xa9", b"\xe6", b"\x97", b"\xa5", b"\xf0\x9f", b"\x99\x82", b"\xe6\x97"]
        whole = [c.encode() for c in "éü日本語한국어🙂ñ中文ü"]
        self.pieces = [bytes([32 + i]) for i in range(96)] + partial * 2 + whole[:16]
        self.pieces += [b"?"] * (vocab_size - len(self.pieces))
        self.num_decoded_ids = 0  # how much decoding work was asked of it

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        token_ids = list(token_ids)
        self.num_decoded_ids += len(token_ids)
        return b"".join(self.pieces[t] for t in token_ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 for c in text]  # printable ASCII only


class ChatByteTokenizer(ByteTokenizer):
    """`ByteTokenizer` with a one-line chat template, so that a tiny model can serve /v1/chat/completions. Like
    Hugging Face's fast tokenizers, `encode` refuses text that is not valid Unicode (a lone surrogate) with a
    cryptic TypeError."""

    chat_template = "{role}: {content}|"

    def __init__(self, vocab_size: int = 128) -> None:
        super().__init__(vocab_size)
        self.render_threads: list[str] = []  # the thread of each apply_chat_template call, by name

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True, tokenize: bool = False) -> str:
        self.render_threads.append(threading.current_thread().name)
        text = "".join(self.chat_template.format(**message) for message in conversation)
        return text + ("assistant:" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, "
                            "InputSequence]]") from None
        return super().encode(text)


def tiny_server_engine(tokenizer=None, **config):
    """An `LLMEngine` over the tiny llama and a `ChatByteTokenizer` (or `tokenizer`), for a fast server."""
    from pagedlab.config import EngineConfig
    from pagedlab.engine import LLMEngine

    config = dict(preemption_mode="recompute", num_kv_blocks=256, max_num_seqs=32, record_trace=False) | config
    return LLMEngine(tiny_model(), tokenizer or ChatByteTokenizer(), EngineConfig(**config))


FAIL_TOKEN = 666  # a prompt starting with this token fails in the engine (finish_reason "error")


class FakeEngine:
    """The public surface of `LLMEngine`: each step gives every request one token, `t<number>`."""

    tokenizer = None
    max_model_len = 64

    def __init__(self, step_seconds: float = 0.0, die_at_step: int | None = None) -> None:
        self.step_seconds, self.die_at_step = step_seconds, die_at_step
        self.requests: dict[str, list] = {}
        self.aborted: list[str] = []
        self.num_steps = 0
        self.step_threads: set[int] = set()

    def add_request(self, request_id, prompt, params):
        ids = list(prompt["prompt_token_ids"])
        if not ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        assert params.output_kind == RequestOutputKind.DELTA
        self.requests[request_id] = [ids, params, 0]
        return request_id

    def step(self):
        self.step_threads.add(threading.get_ident())
        self.num_steps += 1
        if self.num_steps == self.die_at_step:
            raise RuntimeError("the model runner broke")
        time.sleep(self.step_seconds)
        outputs = []
        for request_id, entry in list(self.requests.items()):
            ids, params, done = entry
            if ids[0] == FAIL_TOKEN:
                del self.requests[request_id]
                error = CompletionOutput(0, "", [], "error", error="ValueError: boom")
                outputs.append(RequestOutput(request_id, None, ids, [error], True))
                continue
            entry[2] = done = done + 1
            finished = done >= params.max_tokens
            reason = "length" if finished else None
            completion = CompletionOutput(0, f"t{done} ", [done], reason, logprobs=[{done: -0.5}])
            outputs.append(RequestOutput(request_id, None, ids, [completion], finished))
            if finished:
                del self.requests[request_id]
        return outputs

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)
        self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def stats(self) -> EngineStats:
        n = len(self.requests)
        return EngineStats(num_kv_blocks=16, num_used_blocks=n, peak_used_blocks=n, block_size=16, num_running=n,
                           num_waiting=0, num_steps=self.num_steps, num_computed_tokens=0, num_generated_tokens=0,
                           num_finished=0, num_preemptions=0, prefix_cache_queries=10 * self.num_steps)


class InOrderPipeline:
    """An in-process stand-in for P pipeline stages around a `Worker`: up to `max_concurrent_batches` steps in
    flight, each run (in the order sent, as every stage runs its batches) only when its output or a later one's is
    asked for, so that the scheduler meets what a real pipeline gives it (a batch whose tokens are not known when
    the next is scheduled, aborts and frees in between) without starting a process."""

    def __init__(self, worker, max_concurrent_batches: int) -> None:
        self.worker, self.info, self.max_concurrent_batches = worker, worker.info, max_concurrent_batches
        self.pending: list = []  # [SchedulerOutput, its output or None], oldest first
        self.max_in_flight = 0

    def __getattr__(self, name):  # model_runner, cpu_kv_cache, ...: the worker's
        return getattr(self.worker, name)

    def execute_model(self, scheduler_output, non_block: bool = False):
        entry = [scheduler_output, None]
        self.pending.append(entry)
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        future = _InOrderFuture(self, entry)
        return future if non_block else future.result()

    def _run_until(self, entry) -> None:
        while entry in self.pending:
            oldest = self.pending.pop(0)
            oldest[1] = self.worker.execute_model(oldest[0])

    def shutdown(self) -> None:
        self.worker.shutdown()


class _InOrderFuture:
    def __init__(self, pipeline: InOrderPipeline, entry: list) -> None:
        self.pipeline, self.entry = pipeline, entry

    def result(self):
        self.pipeline._run_until(self.entry)
        return self.entry[1]
