"""EAGLE-3 drafting cost against the real CPU target, and the acceptance rate it needs to pay off.

    python bench/eagle3.py [--gguf ~/.cache/hetero-run/cpu-pair/qwen2.5-coder-0.5b-instruct.gguf] [--k 1,2,3,4,6]
                           [--context 256] [--repeats 15] [--dtype fp32|bf16] [--json]

No trained EAGLE-3 head exists for this target, so the head here is random, shaped as one
would be for it (hidden size, heads and vocabulary of the target, draft vocabulary 32000, aux
states entering layers 2, L/2, L-3): its cost is real, its acceptance is not. Per draft
length k it measures, at `--context` tokens of context, medians over `--repeats`:
  target step   one target forward of 1 token (plain decoding's cost per token)
  verify        one target forward of k + 1 tokens, incl. fusing the captured states (fc)
  draft         one EAGLE-3 round: the head runs the committed token with the target's states,
                then k - 1 chained steps on its own output, each with its draft-vocabulary
                logits and choice
and derives, with i.i.d. acceptance a per draft token, E[tokens per round] =
(1 - a^(k+1)) / (1 - a) and speed-up(a) = E[tokens per round] / ((draft + verify) / target
step); break-even is the a where the speed-up is 1. Prints a rich table and one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_GGUF = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetero-run" / "cpu-pair" \
    / "qwen2.5-coder-0.5b-instruct.gguf"  # `hetero-run fetch cpu-pair`


def write_random_head(dest: Path, config, draft_vocab: int = 32000, seed: int = 0) -> Path:
    """A random EAGLE-3 head (EAGLE layout, SpecForge numbering) shaped for target `config`."""
    from safetensors.torch import save_file

    h, vocab, layers = config.hidden_size, config.vocab_size, config.num_layers
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    inter = config.intermediate_size
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    chosen = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    tensors = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, h), "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "midlayer.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": rand(draft_vocab, h),
        "d2t": chosen - torch.arange(draft_vocab), "t2d": t2d,
    }
    cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_act="silu", hidden_size=h,
               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
               num_hidden_layers=1, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope.theta,
               max_position_embeddings=config.max_positions, vocab_size=vocab, draft_vocab_size=draft_vocab,
               target_hidden_size=h, torch_dtype="bfloat16",
               eagle_config={"eagle_aux_hidden_state_layer_ids": [1, layers // 2 - 1, layers - 4],
                             "use_aux_hidden_state": True})
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def tokens_per_round(a: float, k: int) -> float:
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def break_even(k: int, cost_ratio: float) -> float | None:
    """The acceptance a with tokens_per_round(a, k) == cost_ratio (None: not reachable)."""
    if tokens_per_round(1.0, k) < cost_ratio:
        return None
    if cost_ratio <= 1:
        return 0.0  # the round costs no more than one target step: any acceptance pays
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if tokens_per_round(mid, k) < cost_ratio else (low, mid)
    return high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--k", default="1,2,3,4,6", help="draft lengths (default %(default)s)")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the cache (default 256)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="target and head dtype")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from transformers import AutoTokenizer

    from hetero_run.runtime.eagle3 import load_eagle3
    from hetero_run.runtime.models.loader import load_model

    if not args.gguf.is_file():
        sys.exit(f"{args.gguf}: no such GGUF file (the CPU target)")
    ks = [int(x) for x in args.k.split(",")]
    target = load_model(args.gguf, max_tokens=args.context + 64, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name)
    with tempfile.TemporaryDirectory(prefix="hetero-run-eagle3-bench-") as tmp:
        head_dir = write_random_head(Path(tmp) / "head", target.config)
        drafter = load_eagle3(head_dir, target, tokenizer).model
    n = args.context
    prompt = torch.randint(0, 30000, (n,))
    target.forward(prompt, torch.arange(n), num_logits=1)  # the context (its states go to the head's log)
    drafter.truncate(0)
    drafter.forward(prompt)  # the head catches up on the context
    tokens = drafter.length

    def target_step():
        target.truncate(n)
        target.forward(torch.tensor([11]), torch.tensor([n]))

    def verify(k):
        target.truncate(n)
        target.forward(torch.arange(100, 101 + k), torch.arange(n, n + k + 1))

    head = drafter.prune_head(drafter.draft_target_ids)

    def draft(k):
        drafter.truncate(tokens)
        logits = drafter.forward(torch.tensor([7]), head=head)  # the committed token, target states
        for _ in range(k - 1):
            token = drafter.draft_target_ids[logits[-1].argmax()]
            logits = drafter.forward(token.view(1), head=head)
        drafter.draft_target_ids[logits[-1].argmax()]

    # interleaved, so a load spike on a shared machine hits every figure alike
    times: dict[str, list[float]] = {"step": []} | {f"v{k}": [] for k in ks} | {f"d{k}": [] for k in ks}

    def timed(name: str, fn) -> None:
        begin = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - begin)

    for _ in range(args.repeats + 1):  # the first pass warms up
        timed("step", target_step)
        for k in ks:
            timed(f"v{k}", lambda k=k: verify(k))
            target.truncate(n)
            target.forward(torch.tensor([7]), torch.tensor([n]))  # the head's next token has a target row
            timed(f"d{k}", lambda k=k: draft(k))
    step = statistics.median(times["step"][1:])
    rows = []
    for k in ks:
        v, d = statistics.median(times[f"v{k}"][1:]), statistics.median(times[f"d{k}"][1:])
        ratio = (d + v) / step
        rows.append({"k": k, "draft_ms": 1e3 * d, "draft_step_ms": 1e3 * d / k, "verify_ms": 1e3 * v,
                     "round_over_target_step": ratio, "break_even_acceptance": break_even(k, ratio),
                     "speedup_at_acceptance": {str(a): tokens_per_round(a, k) / ratio for a in (0.5, 0.7, 0.8, 0.9)}})
    result = {"target": str(args.gguf), "dtype": args.dtype, "context": n, "threads": torch.get_num_threads(),
              "target_step_ms": 1e3 * step,
              "head_parameters_m": drafter.head.nbytes / drafter.head.dtype.itemsize / 1e6,
              "draft_vocab": drafter.head.config.draft_vocab_size, "aux_layers": list(drafter.aux_layers),
              "rows": rows, "note": "random head: costs are real, acceptance is not; no EAGLE-3 speed-up measured"}
    if not args.json:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"EAGLE-3 round cost vs target step ({args.dtype}, context {n}, target step "
                            f"{1e3 * step:.1f} ms, head {result['head_parameters_m']:.0f} M params)")
        for col in ("k", "draft ms", "ms/draft step", "verify ms", "round / step", "break-even a",
                    "speed-up a=0.7", "a=0.8", "a=0.9"):
            table.add_column(col, justify="right")
        for r in rows:
            be = r["break_even_acceptance"]
            s = r["speedup_at_acceptance"]
            table.add_row(str(r["k"]), f"{r['draft_ms']:.2f}", f"{r['draft_step_ms']:.2f}", f"{r['verify_ms']:.2f}",
                          f"{r['round_over_target_step']:.2f}", "never" if be is None else f"{be:.3f}",
                          f"{s['0.7']:.2f}x", f"{s['0.8']:.2f}x", f"{s['0.9']:.2f}x")
        Console().print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
