"""Load a drafter: a transformers causal-LM directory, a GGUF file or a converted drafter, with its tokenizer.

Drafters live on rank 0 only. llama / qwen2 / qwen3 drafters run as the fast drafter
(`network.DraftNetwork`: the compiled step, a KV cache with sequence slots) from a converted
checkpoint (`cache`): made from the source on the first load (GGUF files are dequantised by
transformers, which needs the `gguf` package), reused afterwards. Other architectures (Gemma 3)
run through transformers (`hf.HFDraftNetwork`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hetero_run.runtime.drafters import cache
from hetero_run.runtime.drafters.fast import ARCHITECTURES as FAST_ARCHITECTURES
from hetero_run.runtime.drafters.hf import HFDraftNetwork
from hetero_run.runtime.drafters.model import DraftModel
from hetero_run.topology.errors import UserError

log = logging.getLogger("hetero_run.runtime.drafters.load")

WEIGHTS = ("dense", "nvfp4")


class Drafter:
    """A drafter and its tokenizer. `network` has the sequence slots (an engine drafting for many
    sequences acquires one per sequence); `model` is the single-sequence view the speculative
    engine uses, on a slot taken the first time it is asked for."""

    def __init__(self, model: DraftModel | None, tokenizer, source: str, network=None):
        if model is None and network is None:
            raise ValueError("a drafter needs a model or a network")
        self._model, self.tokenizer, self.source, self.network = model, tokenizer, source, network

    @property
    def model(self) -> DraftModel:
        if self._model is None:
            self._model = self.network.view(self.network.acquire())
        return self._model

    @contextmanager
    def borrowed(self) -> Iterator[DraftModel]:
        """A single-sequence view for a moment (timing a step): `model` once it exists, else a
        free slot's, returned afterwards, so an engine lending slots loses none."""
        if self._model is not None or self.network is None:
            yield self.model
            return
        slot = self.network.acquire()
        try:
            yield self.network.view(slot)
        finally:
            self.network.release(slot)

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
                 max_tokens: int = 4096, fast: bool = True, weights: str = "dense", slots: int = 1,
                 cache_root: str | Path | bool | None = None) -> Drafter:
    """The drafter at `path`, ready to draft, with `slots` sequence slots of `max_tokens` each.

    `path`: a model directory, a GGUF file or a converted drafter directory. llama / qwen2 /
    qwen3 drafters run as the fast drafter (`fast=False`: through transformers), with
    projections and head in NVFP4 for `weights="nvfp4"` (a quarter of bf16's bytes per step),
    loaded from their converted checkpoint, made on the first load: beside the source, or
    under `cache_root` when given (False: convert in memory, write nothing).
    """
    if weights not in WEIGHTS:
        raise UserError(f"drafter weights must be dense or nvfp4, got {weights!r}", field="drafter_weights")
    if dtype not in cache.DTYPE_NAMES:
        raise UserError(f"the drafter runs in bf16 or float32, got {dtype}", field="dtype")
    if slots < 1 or max_tokens < 1:
        raise UserError(f"a drafter needs at least one slot of at least one token, got {slots} slot(s) of "
                        f"{max_tokens}", field="slots" if slots < 1 else "max_tokens")
    path = Path(path)
    begin = time.perf_counter()
    if cache.is_converted(path):
        return _fast(path, dtype, weights, slots, max_tokens, begin, source=path)
    _from_pretrained_args(path)  # a missing or unusable path is a one-line error before anything loads
    loaded: dict = {}
    if fast and device == "cpu":
        root = None if cache_root in (None, True, False) else Path(cache_root)
        if cache_root is not False and cache.valid(cache.location(path, weights, dtype, root), path, weights, dtype):
            return _fast(cache.location(path, weights, dtype, root), dtype, weights, slots, max_tokens, begin,
                         source=path)
        if _architecture(path) in FAST_ARCHITECTURES:
            def convert():
                return _convert(path, dtype, weights, loaded)

            if cache_root is False:
                made = convert()
                if made is not None:
                    return _fast_from(made[0], made[1], path, weights, slots, max_tokens, begin)
            else:
                converted = cache.converted(path, weights, dtype, convert, root)
                if converted is not None:
                    return _fast(converted, dtype, weights, slots, max_tokens, begin, source=path)
    model = loaded.get("hf") or _transformers_model(path, dtype)
    network = HFDraftNetwork(model.to(device=device, dtype=dtype).eval(), slots, max_tokens)
    log.info("drafter %s: %s, %.0f M parameters, %s, transformers, %d slot(s), loaded in %.1f s", path.name,
             model.config.model_type, sum(p.numel() for p in model.parameters()) / 1e6,
             str(dtype).removeprefix("torch."), slots, time.perf_counter() - begin)
    return Drafter(None, loaded.get("tokenizer") or load_tokenizer(path), str(path), network)


def _architecture(path: Path) -> str | None:
    """The model type a GGUF file's header or a directory's config.json names (None if unreadable:
    transformers then says what is wrong)."""
    import json

    try:
        if path.is_file():
            from hetero_run.runtime.planner.gguf_header import read_gguf_header

            return read_gguf_header(path).metadata.get("general.architecture")
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, UserError):
        return None


def _transformers_model(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    where, extra = _from_pretrained_args(path)
    try:  # GGUF tensors are dequantised to float32 first
        return AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32 if extra else dtype, **extra).eval()
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot load it as a causal LM: {e}", file=path, field="drafter") from e


def _convert(path: Path, dtype: torch.dtype, weights: str, loaded: dict):
    """(StepWeights, tokenizer, transformers config) for a fast architecture, else None (and
    what it loaded stays in `loaded` for the transformers path). `loaded` keeps the float32
    weights too, for converting the same source to another kind."""
    from hetero_run.runtime.drafters import weights as draft_weights
    from hetero_run.runtime.models.loader import load_model

    if "float32" not in loaded:
        loaded["tokenizer"] = load_tokenizer(path)
        if path.is_dir():  # the runtime reads the safetensors (bf16, float32 or ModelOpt NVFP4) itself
            from transformers import AutoConfig

            config, source = AutoConfig.from_pretrained(str(path)), path
        else:
            model = loaded["hf"] = _transformers_model(path, torch.float32)
            config, source = model.config, model
        loaded["config"] = config
        if config.model_type not in FAST_ARCHITECTURES:
            return None
        runtime_model = load_model(source, max_tokens=1, dtype=torch.float32 if path.is_file() else "auto")
        loaded["float32"] = draft_weights.from_model(runtime_model, torch.float32)
        loaded.pop("hf", None)
    started = time.perf_counter()
    step_weights = loaded["float32"]
    if weights == "nvfp4":
        step_weights = draft_weights.quantize(step_weights)
    step_weights = draft_weights.cast(step_weights, dtype)
    log.info("drafter %s: converted for the fast drafter (%s weights) in %.1f s", path.name, weights,
             time.perf_counter() - started)
    return step_weights, loaded["tokenizer"], loaded["config"]


def prepare_drafter(path: str | Path, kinds: tuple[str, ...] = WEIGHTS, dtype: torch.dtype = torch.bfloat16,
                    cache_root: str | Path | None = None) -> dict[str, tuple[Path, str]]:
    """Make the fast drafter's converted checkpoints of `path` for each projection kind (one
    read of the source for all): {kind: (directory, "verified" | "converted")}; empty for an
    architecture the fast drafter does not run."""
    path = Path(path)
    _from_pretrained_args(path)
    loaded: dict = {}
    out = {}
    for kind in kinds:
        made = []

        def convert(kind=kind, made=made):
            made.append(kind)
            return _convert(path, dtype, kind, loaded)

        converted = cache.converted(path, kind, dtype, convert, None if cache_root is None else Path(cache_root))
        if converted is None:
            return {}
        out[kind] = (converted, "converted" if made else "verified")
    return out


def _fast(converted: Path, dtype: torch.dtype, weights: str, slots: int, max_tokens: int, begin: float,
          source: Path) -> Drafter:
    from hetero_run.runtime.drafters import weights as draft_weights

    manifest = cache.read_manifest(converted)
    if manifest is None:
        raise UserError(f"incomplete converted drafter (its {cache.MANIFEST} is missing, or lists files that are "
                        "not there at their size)", file=converted, field="drafter")
    step_weights = draft_weights.load(converted / cache.WEIGHTS_FILE)
    if manifest.get("dtype") != cache.DTYPE_NAMES[dtype] or manifest.get("weights") != weights:
        step_weights = draft_weights.cast(step_weights, dtype)
    return _fast_from(step_weights, load_tokenizer(converted), source, draft_weights.kind(step_weights), slots,
                      max_tokens, begin)


def _fast_from(step_weights, tokenizer, source: Path, weights: str, slots: int, max_tokens: int,
               begin: float) -> Drafter:
    from hetero_run.runtime.drafters.network import DraftNetwork
    from hetero_run.runtime.drafters.weights import with_fast_activations

    network = DraftNetwork(with_fast_activations(step_weights), slots, max_tokens)
    log.info("drafter %s: fast drafter, %s weights, %d slot(s), %.1f MB read per token, loaded in %.1f s",
             source.name, weights, slots, step_weights.decode_nbytes() / 1e6, time.perf_counter() - begin)
    return Drafter(None, tokenizer, str(source), network)
