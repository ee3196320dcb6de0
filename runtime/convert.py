"""Convert a Hugging Face model directory or GGUF file to a bf16 or NVFP4 safetensors checkpoint.

NVFP4 is produced by NVIDIA ModelOpt itself: `mtq.quantize` with NVFP4_DEFAULT_CFG and max
calibration over a few built-in texts, then `export_hf_checkpoint`, so the result is exactly
what the real deployment's checkpoints look like (embeddings and lm_head stay bf16).
Tokenizer files travel along. The output appears atomically: everything is written to a
temporary sibling directory that is renamed into place at the end, with a manifest
(`hetero-run-convert.json`) listing what was converted and each file's size.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hetero_run.runtime.checkpoint import Checkpoint
from hetero_run.topology.errors import UserError

QUANTS = ("nvfp4", "bf16")
MANIFEST = "hetero-run-convert.json"
# Calibration sets each NVFP4 input_scale (activation amax); weights need no data. A mix of
# code and prose, as the deployment serves both.
CALIBRATION_TEXTS = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens with a "
    "small model and verifies them with the large one in a single forward pass.",
    "import numpy as np\n\nclass Matrix:\n    def __init__(self, rows):\n        self.rows = np.asarray(rows)\n"
    "    def __matmul__(self, other):\n        return Matrix(self.rows @ other.rows)\n",
    "Summarise: The committee met on Tuesday to review the budget. Spending on infrastructure rose by "
    "twelve percent, while administrative costs fell. The report recommends a phased rollout next year.",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id) GROUP BY name;",
    "Bonjour ! Wie geht es dir? 今日は良い天気ですね。 Числа: 3.14159, 2.71828, 1.41421.",
)
CALIBRATION_MAX_TOKENS = 256


class ConvertError(UserError):
    """The source cannot be converted, or the destination cannot be written."""


@dataclass(frozen=True)
class ConvertOptions:
    source: Path  # a Hugging Face model directory or a .gguf file
    dest: Path
    quant: str  # "nvfp4" | "bf16"
    overwrite: bool = False
    max_shard_size: str = "5GB"
    calibration_texts: tuple[str, ...] = CALIBRATION_TEXTS
    labels: dict[str, str] = field(default_factory=dict)  # stored in the manifest (e.g. the source's sha256)

    def __post_init__(self):
        object.__setattr__(self, "source", Path(self.source))
        object.__setattr__(self, "dest", Path(self.dest))
        if self.quant not in QUANTS:
            raise ConvertError(f"must be one of {', '.join(QUANTS)}, got {self.quant!r}", field="--quant")
        if not self.source.exists():
            raise ConvertError("no such file or directory", file=self.source)
        if self.source.is_file() and self.source.suffix != ".gguf":
            raise ConvertError("expected a .gguf file or a Hugging Face model directory", file=self.source)
        if self.source.is_dir() and not (self.source / "config.json").is_file():
            raise ConvertError("not a Hugging Face model directory (no config.json)", file=self.source)
        if self.dest.exists() and not self.overwrite:
            raise ConvertError("already exists (pass --overwrite to replace it)", file=self.dest)
        if self.dest.resolve() == self.source.resolve():
            raise ConvertError("the destination is the source", file=self.dest)
        if not self.calibration_texts:
            raise ConvertError("needs at least one calibration text", field="calibration_texts")


@dataclass
class ConvertReport:
    source: str
    dest: str
    quant: str
    architecture: str
    parameters: int
    source_bytes: int
    dest_bytes: int
    quantized_linears: int = 0  # weights written as NVFP4 (each MoE expert's counts)
    seconds: dict[str, float] = field(default_factory=dict)  # load, quantize, export
    labels: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def convert(opts: ConvertOptions) -> ConvertReport:
    """Load `opts.source` in bf16, convert, and write `opts.dest` atomically."""
    start = time.perf_counter()
    model, tokenizer = load_source(opts.source)
    loaded = time.perf_counter()
    report = save_converted(model, tokenizer, opts.dest, opts.quant, overwrite=opts.overwrite,
                            max_shard_size=opts.max_shard_size, calibration_texts=opts.calibration_texts,
                            source=opts.source, labels=opts.labels)
    report.seconds = {"load": loaded - start, **report.seconds}
    return report


def load_source(source: Path, dtype: torch.dtype = torch.bfloat16):
    """(model, tokenizer) from a model directory or a GGUF file (dequantised by transformers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(source)
    if source.is_dir() and (source / "hf_quant_config.json").is_file():
        raise ConvertError("is already a quantised checkpoint; convert its unquantised original",
                           file=source / "hf_quant_config.json")
    where, kwargs = (source.parent, {"gguf_file": source.name}) if source.is_file() else (source, {})
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ConvertError(f"cannot load a tokenizer: {_first_line(exc)}", file=source) from None
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ConvertError(f"cannot load the model: {_first_line(exc)}", file=source) from None
    return model.eval(), tokenizer


def _forget_gguf_origin(model, source: Path | str) -> None:
    """A model read from a GGUF file carries transformers' GGUF quantizer, which refuses
    `save_pretrained` although the weights were de-quantised on loading; drop it (and its
    `quantization_config`) so the plain weights are written. Weights still packed in GGUF blocks
    cannot be written as bf16: say so."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or getattr(method, "value", method) != "gguf":
        return
    if getattr(quantizer, "packed_modules", None):
        raise ConvertError("its weights stayed packed in GGUF blocks on loading; cannot write them as bf16",
                           file=source or None)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def save_converted(
    model,
    tokenizer,
    dest: Path,
    quant: str,
    *,
    overwrite: bool = False,
    max_shard_size: str = "5GB",
    calibration_texts: tuple[str, ...] = CALIBRATION_TEXTS,
    source: Path | str = "",
    labels: dict[str, str] | None = None,
) -> ConvertReport:
    """Write a transformers `model` (+ tokenizer, if not None) to `dest` as bf16 or NVFP4."""
    dest = Path(dest)
    if quant not in QUANTS:
        raise ConvertError(f"must be one of {', '.join(QUANTS)}, got {quant!r}", field="--quant")
    if dest.exists() and not overwrite:
        raise ConvertError("already exists (pass --overwrite to replace it)", file=dest)
    if not model.config.architectures:  # GGUF-loaded configs have none, and export needs it
        model.config.architectures = [type(model).__name__]
    params = sum(p.numel() for p in model.parameters())
    seconds: dict[str, float] = {}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        t0 = time.perf_counter()
        if quant == "nvfp4":
            quantize_nvfp4(model, tokenizer, calibration_texts)
            seconds["quantize"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            _export_nvfp4(model, tmp, max_shard_size)
        else:
            _forget_gguf_origin(model, source)
            model.to(torch.bfloat16).save_pretrained(tmp, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        seconds["export"] = time.perf_counter() - t0
        written = Checkpoint.open(tmp)  # reads the headers back: a broken export fails here
        quantized = sum(1 for name in written.tensors if name.endswith(".weight_scale"))
        report = ConvertReport(
            source=str(source), dest=str(dest), quant=quant, architecture=model.config.architectures[0],
            parameters=params, source_bytes=_size(Path(source)) if source else 0,
            dest_bytes=0, quantized_linears=quantized, seconds=seconds, labels=dict(labels or {}),
        )
        report.dest_bytes = _size(tmp)
        _write_manifest(tmp, report)
        _replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def quantize_nvfp4(model, tokenizer, texts: tuple[str, ...] = CALIBRATION_TEXTS) -> None:
    """Insert ModelOpt NVFP4 quantizers and calibrate them (max calibration) on `texts`."""
    with _quiet():
        import modelopt.torch.quantization as mtq

    batches = [_calibration_ids(model, tokenizer, text) for text in texts]

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(input_ids=ids)

    with _quiet():
        mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)


def _calibration_ids(model, tokenizer, text: str) -> torch.Tensor:
    if tokenizer is not None:
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :CALIBRATION_MAX_TOKENS]
    else:  # no tokenizer: bytes as ids, folded into the vocabulary
        ids = torch.tensor([list(text.encode())[:CALIBRATION_MAX_TOKENS]])
    return ids.clamp(max=model.config.vocab_size - 1)


def _export_nvfp4(model, out_dir: Path, max_shard_size: str) -> None:
    with _quiet():
        from modelopt.torch.export import export_hf_checkpoint

        export_hf_checkpoint(model, export_dir=out_dir, max_shard_size=max_shard_size)


@contextlib.contextmanager
def _quiet():
    """ModelOpt prints progress to stdout and warns a lot; keep stdout for results."""
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _write_manifest(out_dir: Path, report: ConvertReport) -> None:
    files = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir()) if p.is_file()}
    manifest = {"format": 1, **report.to_json(), "files": files}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(path: Path) -> dict | None:
    """The manifest of a converted directory, or None if it has none or is incomplete
    (a listed file missing or of another size)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for name, size in files.items():
        file = Path(path) / name
        if not file.is_file() or file.stat().st_size != size:
            return None
    return manifest


def _replace(tmp: Path, dest: Path) -> None:
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.rename(tmp, dest)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
