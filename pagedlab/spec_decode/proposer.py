"""Build the proposer a `SpeculativeConfig` asks for, beside an engine's target model and KV cache.

# Explained in chapters/11_speculative_decoding.ipynb
"""

from __future__ import annotations

from pagedlab.config import EngineConfig
from pagedlab.spec_decode.ngram_proposer import NgramProposer


def make_proposer(config: EngineConfig, target, num_blocks: int, attention_backend: str):
    """An `NgramProposer` or a `DraftModelProposer` (None without a speculative_config)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from pagedlab.models import load_model
    from pagedlab.spec_decode.draft_model import DraftModelProposer, check_draft_model

    parameter = next(target.parameters())
    draft, _ = load_model(spec.model, None, parameter.dtype, parameter.device)
    check_draft_model(draft, target)
    k = spec.num_speculative_tokens
    return DraftModelProposer(
        draft, k, DraftModelProposer.num_blocks_for(num_blocks, config.max_num_seqs, k, config.block_size),
        config.block_size, config.max_num_batched_tokens, config.enable_prefix_caching, config.seed, attention_backend,
    )
