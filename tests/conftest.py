"""Shared fixtures: tiny random models of each supported family, the embedded SmolLM2, and HF references."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU; set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
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

# At the default init (std 0.02) the top logits of a random model nearly tie and greedy equality flakes;
# std 0.1 keeps the top-2 gap well above float noise.
_TINY = dict(
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
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_TINY)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_TINY)),
    # 6 query heads over 2 KV heads and a head_dim of 80 (not a power of two)
    "llama-gqa3-hd80": lambda: LlamaForCausalLM(
        LlamaConfig(**{**_TINY, "hidden_size": 96, "num_attention_heads": 6, "head_dim": 80})
    ),
    "mistral-window8": lambda: MistralForCausalLM(MistralConfig(**_TINY, sliding_window=8)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_TINY, head_dim=16)),
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


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (float32) and its tokenizer, loaded once."""
    from pagedlab.models import load_model

    return load_model(None, None, torch.float32, torch.device("cpu"))


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


def pytest_collection_modifyitems(config, items):
    """Tests that load the embedded SmolLM2 are slow (`make test-fast` leaves them out)."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
