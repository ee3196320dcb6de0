"""Linear layers at the real models' shapes: NVFP4 vs bf16 vs fp32, decode-shaped and prefill-sized.

    python bench/nvfp4_linear.py [--batch 1 8] [--prefill 128 512] [--json] [--seconds 0.5]
                                 [--working-set-mb 1024] [--threads N] [--cpu-time]

For each layer shape and batch size (1 = decode, 8 = verifying a draft) it times y = x @ W.T:
  nvfp4        runtime NVFP4Weight (packed codes + fp8 scales; compiled kernel when available)
  bf16         runtime DenseWeight in bf16 (compiled kernel when available)
  bf16 torch   torch.nn.functional.linear on bf16
  fp32 torch   torch.nn.functional.linear on fp32
Each product cycles through enough copies of its weight that the working set exceeds the
caches (default 1 GiB), as in a real decode step, so the figures are memory-system figures;
the best pass over all copies within --seconds is reported (other load only slows passes down).
Activations are bf16 (fp32 for the fp32 format).
GB/s counts the bytes each format must read. The summary adds up one decode step of
Qwen2.5-Coder-0.5B (24 layers + lm_head) per format.

Prefill (--prefill, default 128 and 512 rows; 0 to skip): the compiled kernels, which take every
row count, against what prefill ran on before they did, for bf16 and float32 activations:
  nvfp4        the compiled NVFP4 kernel
  nvfp4 tiles  W dequantised 4 MiB at a time by the compiled kernel (float32), times torch's
               float32 GEMM
  dense        the compiled dense kernel (bf16 weights for bf16 x, float32 weights for float32 x)
  dense torch  torch.nn.functional.linear on the same weights
one weight per shape (a prefill product is compute-bound), best of --seconds, with the ratio
kernel / torch (below 1: the kernel is faster). Figures vary with machine load; rerun on a
quiet machine for reference numbers, or time CPU time with `--threads 1 --cpu-time` where
other jobs share the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table

from hetero_run.kernels import cpu_ext
from hetero_run.runtime.weights import DenseWeight, NVFP4Weight

# (model, layer, out, in, count per decode step)
QWEN25_05B = [
    ("qwen2.5-0.5b", "qkv (fused)", 896 + 2 * 128, 896, 24),
    ("qwen2.5-0.5b", "o_proj", 896, 896, 24),
    ("qwen2.5-0.5b", "gate_up (fused)", 2 * 4864, 896, 24),
    ("qwen2.5-0.5b", "down_proj", 896, 4864, 24),
    ("qwen2.5-0.5b", "lm_head", 151936, 896, 1),
]
QWEN3_235B_TP2 = [  # one rank's slice at TP=2
    ("qwen3-235b tp2", "qkv (fused)", (64 * 128 + 2 * 4 * 128) // 2, 4096, 94),
    ("qwen3-235b tp2", "o_proj", 4096, 64 * 128 // 2, 94),
    ("qwen3-235b tp2", "expert gate_up", 2 * 1536 // 2, 4096, 94 * 8),
    ("qwen3-235b tp2", "expert down", 4096, 1536 // 2, 94 * 8),
]
FORMATS = ("nvfp4", "bf16", "bf16 torch", "fp32 torch")
CLOCK = [time.perf_counter]  # or time.process_time (--cpu-time)


@dataclass
class Result:
    model: str
    layer: str
    out_features: int
    in_features: int
    batch: int
    format: str
    ms: float
    gb_per_s: float
    resident_bytes: int
    per_step: int


def _make(fmt: str, w: torch.Tensor):
    """(callable x -> y, resident bytes) for one copy of weight w in format fmt."""
    if fmt == "nvfp4":
        lin = NVFP4Weight.quantize(w, activation="w4a16")
        return lin.matmul, lin.nbytes
    if fmt == "bf16":
        lin = DenseWeight(w.bfloat16())
        return lin.matmul, lin.nbytes
    dtype = torch.bfloat16 if fmt == "bf16 torch" else torch.float32
    wt = w.to(dtype)
    return (lambda x: torch.nn.functional.linear(x.to(dtype), wt)), wt.numel() * wt.element_size()


def _clone(fmt: str, w: torch.Tensor, first):
    """More copies of the same weight, cheaply (no re-quantisation)."""
    fn, nbytes = first
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, NVFP4Weight):
        lin = NVFP4Weight(owner.codes.clone(), owner.block_scale.clone(), owner.row_scale.clone(), None, "w4a16")
        return lin.matmul
    if isinstance(owner, DenseWeight):
        return DenseWeight(owner.weight.clone()).matmul
    return _make(fmt, w)[0]


def measure(fmt: str, out_f: int, in_f: int, batch: int, seconds: float, working_set: int) -> tuple[float, int]:
    w = torch.randn(out_f, in_f) * 0.02
    first = _make(fmt, w)
    nbytes = first[1]
    copies = max(1, math.ceil(working_set / nbytes))
    fns = [first[0]] + [_clone(fmt, w, first) for _ in range(copies - 1)]
    del w
    x = torch.randn(batch, in_f, dtype=torch.bfloat16 if fmt != "fp32 torch" else torch.float32)
    for fn in fns[: min(len(fns), 4)]:
        fn(x)
    # Best pass over all copies: other processes on a shared machine only ever slow a pass down.
    clock = CLOCK[0]
    best, start = float("inf"), clock()
    while clock() - start < seconds or best == float("inf"):
        t0 = clock()
        for fn in fns:
            fn(x)
        best = min(best, (clock() - t0) / len(fns))
    return best, nbytes


def run(shapes, batches, seconds: float, working_set: int) -> list[Result]:
    results = []
    for model, layer, out_f, in_f, per_step in shapes:
        for batch in batches:
            for fmt in FORMATS:
                t, nbytes = measure(fmt, out_f, in_f, batch, seconds, working_set)
                results.append(Result(model, layer, out_f, in_f, batch, fmt, t * 1e3, nbytes / t / 1e9, nbytes,
                                      per_step))
    return results


def decode_step(results: list[Result], model: str, batch: int) -> dict[str, float]:
    """ms per decode step (all linear layers of `model`) per format."""
    out = {}
    for fmt in FORMATS:
        rows = [r for r in results if r.model == model and r.batch == batch and r.format == fmt]
        out[fmt] = sum(r.ms * r.per_step for r in rows)
    return out


def print_tables(console: Console, results: list[Result], batches) -> None:
    table = Table(title="y = x @ W.T: ms per product (GB/s of the bytes each format reads)")
    table.add_column("model / layer")
    table.add_column("[out, in]", justify="right")
    table.add_column("n", justify="right")
    for fmt in FORMATS:
        table.add_column(fmt, justify="right")
    table.add_column("MB nvfp4 / bf16 / fp32", justify="right")
    table.add_column("nvfp4 speed-up vs bf16 torch / bf16", justify="right")
    seen: list[tuple] = []
    for r in results:
        key = (r.model, r.layer, r.out_features, r.in_features, r.batch)
        if key not in seen:
            seen.append(key)
    for model, layer, out_f, in_f, batch in seen:
        row = {r.format: r for r in results
               if (r.model, r.layer, r.out_features, r.in_features, r.batch) == (model, layer, out_f, in_f, batch)}
        sizes = " / ".join(f"{row[f].resident_bytes / 1e6:.1f}" for f in ("nvfp4", "bf16", "fp32 torch"))
        table.add_row(f"{model} {layer}", f"[{out_f}, {in_f}]", str(batch),
                      *(f"{row[f].ms:.3f} ({row[f].gb_per_s:.0f})" for f in FORMATS), sizes,
                      f"{row['bf16 torch'].ms / row['nvfp4'].ms:.2f}x / {row['bf16'].ms / row['nvfp4'].ms:.2f}x")
    console.print(table)
    models = list(dict.fromkeys(r.model for r in results))
    summary = Table(title="one decode step, all linear layers: ms (steps/s if nothing else ran)")
    summary.add_column("model")
    summary.add_column("n", justify="right")
    for fmt in FORMATS:
        summary.add_column(fmt, justify="right")
    for model in models:
        for batch in batches:
            step = decode_step(results, model, batch)
            summary.add_row(model, str(batch), *(f"{step[f]:.1f} ({1e3 / step[f]:.1f}/s)" for f in FORMATS))
    console.print(summary)


PREFILL_FORMATS = ("nvfp4", "nvfp4 tiles", "dense", "dense torch")
TILE_ELEMENTS = 1 << 20  # the tiles of the path prefill took before the kernels took every row count


@dataclass
class PrefillResult:
    model: str
    layer: str
    out_features: int
    in_features: int
    rows: int
    x_dtype: str
    ms: dict


def _prefill_callables(w: torch.Tensor, x_dtype: torch.dtype) -> dict:
    lib = cpu_ext.ops()
    lin = NVFP4Weight.quantize(w, activation="w4a16")
    scales = lin.block_scale.view(torch.uint8)
    tile_rows = max(1, TILE_ELEMENTS // w.shape[1])

    def tiles(x):
        xf = x.float()
        y = torch.empty(x.shape[0], w.shape[0])
        for start in range(0, w.shape[0], tile_rows):
            stop = min(start + tile_rows, w.shape[0])
            y[:, start:stop] = xf @ lib.nvfp4_dequant(lin.codes[start:stop], scales[start:stop],
                                                      lin.row_scale[start:stop]).T
        return y.to(x.dtype)

    dense = DenseWeight(w.to(x_dtype))
    wt = dense.weight
    return {"nvfp4": lin.matmul, "nvfp4 tiles": tiles, "dense": dense.matmul,
            "dense torch": lambda x: torch.nn.functional.linear(x, wt)}


def run_prefill(shapes, rows_list, seconds: float) -> list[PrefillResult]:
    results = []
    for model, layer, out_f, in_f, _ in shapes:
        if layer == "lm_head":  # a prefill needs the logits of its last row only
            continue
        w = torch.randn(out_f, in_f) * 0.02
        for x_dtype in (torch.bfloat16, torch.float32):
            fns = _prefill_callables(w, x_dtype)
            for rows in rows_list:
                x = torch.randn(rows, in_f).to(x_dtype)
                best = {}
                for _ in range(2):  # round robin, so load changes touch every format alike
                    for name in PREFILL_FORMATS:
                        fns[name](x)
                        clock = CLOCK[0]
                        start = clock()
                        while True:
                            t0 = clock()
                            fns[name](x)
                            best[name] = min(best.get(name, float("inf")), clock() - t0)
                            if clock() - start > seconds / 2:
                                break
                results.append(PrefillResult(model, layer, out_f, in_f, rows, str(x_dtype).removeprefix("torch."),
                                             {k: v * 1e3 for k, v in best.items()}))
    return results


def print_prefill(console: Console, results: list[PrefillResult]) -> None:
    table = Table(title="prefill: ms per product, compiled kernel vs the path before it (ratio < 1: kernel faster)")
    for col in ("model / layer", "[out, in]", "rows", "x", *PREFILL_FORMATS, "nvfp4 / tiles", "dense / torch"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(f"{r.model} {r.layer}", f"[{r.out_features}, {r.in_features}]", str(r.rows), r.x_dtype,
                      *(f"{r.ms[f]:.2f}" for f in PREFILL_FORMATS), f"{r.ms['nvfp4'] / r.ms['nvfp4 tiles']:.2f}",
                      f"{r.ms['dense'] / r.ms['dense torch']:.2f}")
    console.print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prefill", type=int, nargs="+", default=[128, 512],
                        help="prefill row counts to compare with the path before the kernels (0: skip)")
    parser.add_argument("--seconds", type=float, default=0.5, help="timing per measurement (default 0.5)")
    parser.add_argument("--working-set-mb", type=int, default=1024, help="bytes cycled through (default 1024)")
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen3-235b"],
                        choices=["qwen2.5-0.5b", "qwen3-235b"])
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--cpu-time", action="store_true", help="time CPU time, not wall time (with --threads 1)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        if torch.get_num_threads() != 1:
            parser.error("--cpu-time needs --threads 1 (other threads' waiting would count)")
        CLOCK[0] = time.process_time
    shapes = (QWEN25_05B if "qwen2.5-0.5b" in args.models else []) + (
        QWEN3_235B_TP2 if "qwen3-235b" in args.models else [])
    lib = cpu_ext.ops()  # build before timing
    env = {"threads": torch.get_num_threads(), "compiled_kernels": lib is not None,
           "cpu_features": cpu_ext.features(), "torch": torch.__version__}
    results = run(shapes, args.batch, args.seconds, args.working_set_mb << 20)
    prefill_rows = [r for r in args.prefill if r > 0]
    prefill = run_prefill(shapes, prefill_rows, args.seconds) if prefill_rows and lib is not None else []
    if args.json:
        models = sorted({r.model for r in results})
        steps = {m: {b: decode_step(results, m, b) for b in args.batch} for m in models}
        print(json.dumps({"env": env, "results": [asdict(r) for r in results], "decode_step_ms": steps,
                          "prefill": [asdict(r) for r in prefill]}))
    else:
        console = Console(width=max(Console().width, 170))
        console.print(f"threads {env['threads']}, compiled kernels {'yes' if lib is not None else 'NO'} "
                      f"({cpu_ext.describe()}), torch {env['torch']}, "
                      f"{'CPU' if CLOCK[0] is time.process_time else 'wall'} time")
        print_tables(console, results, args.batch)
        if prefill:
            print_prefill(console, prefill)
    return 0


if __name__ == "__main__":
    sys.exit(main())
