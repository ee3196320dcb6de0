"""Load a drafter: a transformers causal-LM directory or a GGUF file, with its own tokenizer.

Drafters live on rank 0 only. GGUF files are dequantised by transformers (it needs the
`gguf` package) and then cast to `dtype`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hetero_run.runtime.drafters.fast import ARCHITECTURES as FAST_ARCHITECTURES
from hetero_run.runtime.drafters.fast import FastDraftModel, quantize_nvfp4
from hetero_run.runtime.drafters.hf import HFDraftModel
from hetero_run.runtime.drafters.model import DraftModel
from hetero_run.topology.errors import UserError

log = logging.getLogger("hetero_run.runtime.drafters.load")


@dataclass
class Drafter:
    model: DraftModel
    tokenizer: object  # a transformers fast tokenizer
    source: str  # what the user named, for messages

    @property
    def name(self) -> str:
        return Path(self.source).name


def _from_pretrained_args(path: Path) -> tuple[str, dict]:
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir() and (path / "config.json").is_file():
        return str(path), {}
    if path.is_dir():
        raise UserError("not a model directory: no config.json inside", file=path, field="drafter")
    if not path.exists():
        raise UserError("no such file or directory", file=path, field="drafter")
    raise UserError("expected a model directory (config.json) or a .gguf file", file=path, field="drafter")


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    where, extra = _from_pretrained_args(Path(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load its tokenizer: {e}", file=path, field="drafter") from e
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise UserError("needs a fast (Rust) tokenizer; this one has none", file=path, field="drafter")
    return tokenizer


def load_drafter(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 max_tokens: int = 4096, fast: bool = True, weights: str = "dense") -> Drafter:
    """The drafter at `path`, ready to draft (weights in `dtype`, eval mode, empty KV cache).

    llama / qwen2 / qwen3 drafters run through the runtime's own model code (`fast`, with a
    KV cache of `max_tokens`); other architectures through transformers. `weights="nvfp4"`
    quantises a fast drafter's projections to NVFP4 (a quarter of the bytes per step).
    """
    if weights not in ("dense", "nvfp4"):
        raise UserError(f"drafter weights must be dense or nvfp4, got {weights!r}", field="drafter_weights")
    from transformers import AutoModelForCausalLM

    path = Path(path)
    where, extra = _from_pretrained_args(path)
    begin = time.perf_counter()
    tokenizer = load_tokenizer(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32 if extra else dtype, **extra)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot load it as a causal LM: {e}", file=path, field="drafter") from e
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    if fast and model.config.model_type in FAST_ARCHITECTURES:
        from hetero_run.runtime.models.loader import load_model
        from hetero_run.runtime.models.parallel import ParallelContext

        runtime_model = load_model(model, ParallelContext.single(device), max_tokens=max_tokens, dtype=dtype)
        if weights == "nvfp4":
            quantize_nvfp4(runtime_model)
        draft_model, path_kind = FastDraftModel(runtime_model), f"runtime model code, {weights} weights"
    else:
        draft_model, path_kind = HFDraftModel(model.to(device=device, dtype=dtype).eval()), "transformers"
    log.info("drafter %s: %s, %.0f M parameters, %s, %s, loaded in %.1f s", path.name, model.config.model_type,
             parameters, str(dtype).removeprefix("torch."), path_kind, time.perf_counter() - begin)
    return Drafter(draft_model, tokenizer, str(path))
