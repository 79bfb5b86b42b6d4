"""A self-draft (layer-skip style): the target's own first layers, then its final norm and LM head, as a draft model.

Where no smaller sibling of the target ships (SmolLM2-135M is the smallest of its family), the target's first
few layers give a draft with its vocabulary for free: no new weights, the same modules shared, only their KV
cache is the draft's own. Whether its guesses are good enough to pay is a measurement
(`scripts/spec_decode_bench.py`), not a promise.

    draft = self_draft(model, num_layers=6)
    LLM(model, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})

# Explained in chapters/11_speculative_decoding.ipynb
"""

from __future__ import annotations

import copy

import torch


def self_draft(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A model that runs `model`'s first `num_layers` decoder layers (the same module objects, so the same
    weights and layer indices), then its final norm and LM head. `model` must be a Hugging Face decoder whose
    layers sit in `model.model.layers` (Llama, Qwen2/3, Mistral)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"self_draft needs a decoder with model.model.layers; {type(model).__name__} has none")
    if not isinstance(num_layers, int) or not 1 <= num_layers < len(layers):
        raise ValueError(f"self_draft: num_layers must be from 1 to {len(layers) - 1}, got {num_layers!r}")
    draft = copy.copy(model)  # shallow: shares every submodule; only the layer list and config are its own
    draft._modules = dict(model._modules)
    draft.model = copy.copy(model.model)
    draft.model._modules = dict(model.model._modules)
    draft.model.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    draft.config = copy.deepcopy(model.config)
    draft.config.num_hidden_layers = num_layers
    draft.model.config = draft.config
    if hasattr(draft.config, "layer_types") and draft.config.layer_types is not None:
        draft.config.layer_types = list(draft.config.layer_types)[:num_layers]
    return draft
