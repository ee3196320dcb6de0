"""The compiled drafter step (kernels/drafter_step.py) against its PyTorch reference, rows of one
forward bit-identical to each row alone, a step shared between threads bit-identical to one
thread, trees through a mask, and the checks on bad rows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_support import WIDTHS, capped_width

from hetero_run.kernels import cpu_ext, nvfp4
from hetero_run.kernels.drafter_step import (
    DraftStep,
    Projection,
    StepLayer,
    StepWeights,
    compiled_available,
    rotary_tables,
)


@dataclass(frozen=True)
class Shape:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    d: int = 16
    inter: int = 96
    vocab: int = 50
    layers: int = 2
    slots: int = 3
    max_tokens: int = 24


TINY = Shape()
VOCAB, SLOTS, MAX_TOKENS = TINY.vocab, TINY.slots, TINY.max_tokens
# a step of about 1.7 M multiply-adds a row: enough for the compiled step to share it between threads
WIDE = Shape(hidden=256, heads=4, kv_heads=2, d=64, inter=768, vocab=300)
# head sizes the AVX2 attention has a loop of its own for, over more keys than one of its chunks (32)
HEAD64 = Shape(hidden=192, heads=3, kv_heads=1, d=64, inter=128, vocab=60, layers=1, max_tokens=48)
HEAD128 = Shape(hidden=256, heads=4, kv_heads=2, d=128, inter=128, vocab=60, layers=1, max_tokens=48)


def _projection(out: int, inp: int, kind: str, g: torch.Generator, bias: bool = False) -> Projection:
    w = torch.randn(out, inp, generator=g) * 0.2
    b = torch.randn(out, generator=g) * 0.1 if bias else None
    if kind in ("nvfp4", "nvfp4i8"):  # nvfp4i8: times int8 activations
        q = nvfp4.quantize(w)
        return Projection(codes=q.codes, block_scale=q.block_scale, row_scale=q.global_scale.expand(out).clone(),
                          bias=b, int8_x=kind == "nvfp4i8")
    if kind == "bf16":
        return Projection(weight=w.bfloat16(), bias=b, bf16_x=True)
    return Projection(weight=w, bias=b)


def tiny_weights(kind: str = "fp32", qkv_bias: bool = False, qk_norm: bool = False, seed: int = 0,
                 shape: Shape = TINY) -> StepWeights:
    g = torch.Generator().manual_seed(seed)
    norm = (lambda *dims: 1 + 0.1 * torch.randn(*dims, generator=g))  # noqa: E731
    hidden, heads, kv_heads, d = shape.hidden, shape.heads, shape.kv_heads, shape.d
    layers = [StepLayer(norm(hidden), _projection((heads + 2 * kv_heads) * d, hidden, kind, g, qkv_bias),
                        _projection(hidden, heads * d, kind, g), norm(hidden),
                        _projection(2 * shape.inter, hidden, kind, g), _projection(hidden, shape.inter, kind, g),
                        norm(heads + kv_heads, d) if qk_norm else None)
              for _ in range(shape.layers)]
    embed = torch.randn(shape.vocab, hidden, generator=g)
    return StepWeights(heads, kv_heads, d, 1e-6, embed.bfloat16() if kind != "fp32" else embed, layers,
                       norm(hidden), _projection(shape.vocab, hidden, kind, g))


def make_step(weights: StepWeights, cache_dtype=torch.bfloat16, compiled: bool | None = None,
              shape: Shape = TINY) -> DraftStep:
    dims = (shape.slots, shape.layers, shape.kv_heads, shape.max_tokens, shape.d)
    cos, sin = rotary_tables(1.0 / (10000 ** (torch.arange(0, shape.d, 2).float() / shape.d)), shape.max_tokens)
    return DraftStep(weights, cos, sin, torch.zeros(dims, dtype=cache_dtype), torch.zeros(dims, dtype=cache_dtype),
                     compiled=compiled)


def rows(*triples):
    """(id, slot, position) rows of a chain forward: index = position."""
    ids, slots, positions = (torch.tensor(col, dtype=torch.long) for col in zip(*triples, strict=True))
    return ids, slots, positions.clone(), positions


needs_compiled = pytest.mark.skipif(not compiled_available(), reason="the compiled kernels do not build here")


@pytest.fixture(params=[*WIDTHS, "reference"])
def compiled(request):
    """True: the compiled step at each vector width this CPU runs (the others skipped with the
    reason); False: the PyTorch reference."""
    if request.param == "reference":
        yield False
        return
    lib = cpu_ext.ops()
    if lib is None or not compiled_available():
        pytest.skip("the compiled kernels do not build here")
    with capped_width(lib, request.param):
        yield True

SCRIPT = [  # prefill slot 1, then slot 0, then a step mixing three slots, then one with two rows in slot 0
    [(3, 1, 0), (7, 1, 1), (11, 1, 2), (4, 1, 3), (9, 1, 4)],
    [(5, 0, 0), (6, 0, 1)],
    [(8, 0, 2), (12, 1, 5), (1, 2, 0)],
    [(2, 2, 1), (13, 0, 3), (14, 0, 4)],
]


@needs_compiled
@pytest.mark.parametrize("kind, cache_dtype, qkv_bias, qk_norm", [
    ("fp32", torch.float32, False, False), ("fp32", torch.float32, True, True), ("bf16", torch.bfloat16, True, False),
    ("nvfp4", torch.bfloat16, False, True), ("nvfp4", torch.float32, False, False),
    ("nvfp4i8", torch.float32, True, True), ("nvfp4i8", torch.bfloat16, False, False)])
def test_compiled_step_matches_the_reference(step_width, kind, cache_dtype, qkv_bias, qk_norm):
    weights = tiny_weights(kind, qkv_bias, qk_norm)
    compiled, reference = make_step(weights, cache_dtype, True), make_step(weights, cache_dtype, False)
    tol = 2e-5 if cache_dtype == torch.float32 else 2e-2  # a bf16 cache rounds keys either side of a tie
    for step in SCRIPT:
        got, want = compiled.forward(*rows(*step)), reference.forward(*rows(*step))
        assert got.dtype == torch.float32 and got.shape == (len(step), VOCAB)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(compiled.k_cache.float(), reference.k_cache.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(compiled.v_cache.float(), reference.v_cache.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "nvfp4", "nvfp4i8"])
def test_rows_of_a_batched_forward_equal_each_row_alone(compiled, kind):
    weights = tiny_weights(kind, qkv_bias=True, seed=2)
    batched, alone = make_step(weights, compiled=compiled), make_step(weights, compiled=compiled)
    for step in SCRIPT:
        together = batched.forward(*rows(*step))
        for r, row in enumerate(step):
            assert torch.equal(together[r:r + 1], alone.forward(*rows(row))), (step, r)
    assert torch.equal(batched.k_cache, alone.k_cache) and torch.equal(batched.v_cache, alone.v_cache)


def _chain_logits(weights, tokens: list[int], compiled, shape: Shape = TINY, cache=torch.float32) -> torch.Tensor:
    step = make_step(weights, cache, compiled, shape=shape)
    return step.forward(*rows(*[(t, 0, i) for i, t in enumerate(tokens)]))


@pytest.mark.parametrize("shape, cached, cache", [
    (TINY, 3, torch.float32), (HEAD64, 37, torch.float32), (HEAD128, 37, torch.float32), (HEAD64, 37, torch.bfloat16),
    (HEAD128, 37, torch.bfloat16)], ids=["d16", "d64", "d128", "d64-bf16", "d128-bf16"])
def test_tree_rows_see_only_their_ancestors(compiled, shape, cached, cache):
    """Over a float32 cache and a bf16 one (whose AVX2 attention at head sizes 64 and 128 reads
    each query head straight from the cache)."""
    weights = tiny_weights("fp32", qk_norm=True, seed=3, shape=shape)
    step = make_step(weights, cache, compiled, shape=shape)
    prefix = [(3 + 4 * i) % shape.vocab for i in range(cached)]
    step.forward(*rows(*[(t, 0, i) for i, t in enumerate(prefix)]))
    # nodes 0:a 1:b(<-a) 2:c(<-a) 3:d(<-c) at cache indices n..n+3, positions n + depth
    ids, parents = [20, 21, 22, 23], [-1, 0, 0, 2]
    depth = [0, 1, 1, 2]
    n = len(prefix)
    mask = torch.zeros(4, n + 4, dtype=torch.bool)
    mask[:, :n] = True
    for i, parent in enumerate(parents):
        mask[i, n + i] = True
        while parent >= 0:
            mask[i, n + parent] = True
            parent = parents[parent]
    logits = step.forward(torch.tensor(ids), torch.zeros(4, dtype=torch.long), torch.arange(n, n + 4),
                          torch.tensor(depth) + n, mask)
    chain = (lambda tokens: _chain_logits(weights, prefix + tokens, compiled, shape, cache)[-1])  # noqa: E731
    torch.testing.assert_close(logits[1], chain([20, 21]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[3], chain([20, 22, 23]), atol=1e-5, rtol=1e-5)
    again = make_step(weights, cache, compiled, shape=shape)  # a mask that hides nothing changes no bit
    again.forward(*rows(*[(t, 0, i) for i, t in enumerate(prefix)]))
    plain = again.forward(*rows((20, 0, n)))
    masked = again.forward(*rows((20, 0, n)), torch.ones(1, n + 1, dtype=torch.bool))
    assert torch.equal(plain, masked)
    if compiled:  # and the compiled attention is the reference's
        reference = make_step(weights, cache, False, shape=shape)
        reference.forward(*rows(*[(t, 0, i) for i, t in enumerate(prefix)]))
        want = reference.forward(torch.tensor(ids), torch.zeros(4, dtype=torch.long), torch.arange(n, n + 4),
                                 torch.tensor(depth) + n, mask)
        tol = 1e-4 if cache == torch.float32 else 2e-2  # a bf16 cache rounds keys either side of a tie
        torch.testing.assert_close(logits, want, atol=tol, rtol=tol)


def test_an_extra_head_computes_its_rows(compiled):
    weights = tiny_weights("nvfp4", seed=4)
    step, full = make_step(weights, compiled=compiled), make_step(weights, compiled=compiled)
    picked = torch.tensor([4, 17, 2, 33])
    step.set_head(1, weights.head.rows(picked))
    got = step.forward(*rows((3, 0, 0), (5, 0, 1)), head=1)
    want = full.forward(*rows((3, 0, 0), (5, 0, 1)))[:, picked]
    assert torch.equal(got, want)
    step.set_head(1, None)
    with pytest.raises((RuntimeError, KeyError)):
        step.forward(*rows((6, 0, 2)), head=1)


@pytest.mark.parametrize("kind, shape", [("nvfp4", TINY), ("bf16", WIDE)])
def test_last_gives_the_last_rows_logits_alone(compiled, kind, shape):
    """A prompt or a catch-up wants only its last row's logits: the head runs on that row, the
    layers on all (the cache is the full forward's), and the row has the full forward's bits."""
    weights = tiny_weights(kind, qkv_bias=True, seed=6, shape=shape)
    full, last = make_step(weights, compiled=compiled, shape=shape), make_step(weights, compiled=compiled, shape=shape)
    for script in SCRIPT:
        if len({slot for _, slot, _ in script}) > 1:
            continue  # `last` serves one sequence's chain
        want = full.forward(*rows(*script))[-1:]
        got = last.forward(*rows(*script), last=True)
        assert got.shape == (1, shape.vocab) and torch.equal(got, want)
    assert torch.equal(full.k_cache, last.k_cache) and torch.equal(full.v_cache, last.v_cache)


@needs_compiled
@pytest.mark.parametrize("kind, qkv_bias, qk_norm", [("fp32", True, True), ("bf16", False, False),
                                                     ("nvfp4", True, False), ("nvfp4i8", False, True)])
def test_a_step_shared_between_threads_has_the_bits_of_one_thread(step_width, kind, qkv_bias, qk_norm):
    """The compiled step splits each projection's rows and the attention between threads; every
    logit and cache entry keeps the bits it gets on one thread, for one row and for several."""
    weights = tiny_weights(kind, qkv_bias, qk_norm, seed=5, shape=WIDE)
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            step = make_step(weights, torch.bfloat16, True, shape=WIDE)
            results[threads] = [step.forward(*rows(*script)) for script in SCRIPT] + [step.k_cache, step.v_cache]
    finally:
        torch.set_num_threads(before)
    for one, two in zip(results[1], results[2], strict=True):
        assert torch.equal(one, two)
    # And they are right. A bf16 cache or bf16 activations round a value the other way when the two
    # sums differ in their last float32 bit at a tie; one such flip moves logits of size ~10 by a
    # few hundredths (0.045 on an AVX2 CPU), so the bound scales with the logits.
    reference = make_step(weights, torch.bfloat16, False, shape=WIDE)
    for script, got in zip(SCRIPT, results[2][:len(SCRIPT)], strict=True):
        want = reference.forward(*rows(*script))
        torch.testing.assert_close(got, want, atol=1e-2 * want.abs().max().item(), rtol=2e-2)


@needs_compiled
@pytest.mark.parametrize("bad, match", [
    (dict(ids=[VOCAB]), "token id"), (dict(slots=[SLOTS]), "slot"), (dict(index=[MAX_TOKENS]), "cache index"),
    (dict(positions=[MAX_TOKENS]), "position")])
def test_bad_rows_are_refused(bad, match):
    step = make_step(tiny_weights(), compiled=True)
    args = {"ids": [1], "slots": [0], "index": [0], "positions": [0], **bad}
    with pytest.raises(RuntimeError, match=match):
        step.forward(*(torch.tensor(args[k]) for k in ("ids", "slots", "index", "positions")))


def _bf16_activations(weights: StepWeights) -> StepWeights:
    """NVFP4 projections multiplying x rounded to bf16, as the runtime's drafters run them."""
    from dataclasses import replace

    layers = [replace(layer, qkv=replace(layer.qkv, bf16_x=True), o=replace(layer.o, bf16_x=True),
                      gate_up=replace(layer.gate_up, bf16_x=True), down=replace(layer.down, bf16_x=True))
              for layer in weights.layers]
    return replace(weights, layers=layers, head=replace(weights.head, bf16_x=True))


@needs_compiled
@pytest.mark.parametrize("kernels", ["amx", "vector"])
@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_each_kernel_choice_keeps_every_row_alone_and_right(kernels, kind):
    """The step's projections on AMX tiles or on the vector kernels (the drafter takes the faster,
    runtime/drafters/threads.py): either way each row of a batched forward has the bits it has
    alone, and the logits are the reference's."""
    weights = tiny_weights(kind, qkv_bias=True, seed=7, shape=WIDE)
    if kind == "nvfp4":
        weights = _bf16_activations(weights)
    batched, alone = make_step(weights, shape=WIDE), make_step(weights, shape=WIDE)
    if kernels not in batched.kernel_choices():
        pytest.skip(f"the {kernels} kernels are not a choice here (AMX not listed by CPUID or not self-tested): "
                    f"{batched.kernel_choices()}")
    for step in (batched, alone):
        step.use_kernels(kernels)
        assert step.kernels == (kernels, kernels, 1)
    reference = make_step(weights, compiled=False, shape=WIDE)
    for script in SCRIPT:
        together = batched.forward(*rows(*script))
        for r, row in enumerate(script):
            assert torch.equal(together[r:r + 1], alone.forward(*rows(row))), (script, r)
        want = reference.forward(*rows(*script))
        torch.testing.assert_close(together, want, atol=1e-2 * want.abs().max().item(), rtol=2e-2)


@needs_compiled
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_few_rows_and_many_rows_may_take_different_kernels(n):
    """A drafting step on the vector kernels and a prompt read on the tiles: a forward of fewer
    than `many_from` rows has the bits (logits and cache) of the vector kernels, a wider one those
    of the tiles."""
    weights = _bf16_activations(tiny_weights("nvfp4", qkv_bias=True, seed=8, shape=WIDE))
    split = make_step(weights, shape=WIDE)
    if split.kernel_choices() != ("amx", "vector"):
        pytest.skip(f"AMX is not a choice here (not listed by CPUID or not self-tested): {split.kernel_choices()}")
    split.use_kernels("vector", "amx", many_from=3)
    assert split.kernels == ("vector", "amx", 3)
    single = make_step(weights, shape=WIDE)
    single.use_kernels("amx" if n >= 3 else "vector")
    chain = rows(*[(5 + i, 0, i) for i in range(n)])
    assert torch.equal(split.forward(*chain), single.forward(*chain))
    assert torch.equal(split.k_cache, single.k_cache) and torch.equal(split.v_cache, single.v_cache)


@needs_compiled
def test_kernels_that_are_not_a_choice_are_refused():
    step = make_step(tiny_weights("fp32"), compiled=True)  # float32 activations: no AMX to choose
    assert step.kernel_choices() == ("vector",) and step.kernels == ("vector", "vector", 1)
    with pytest.raises(ValueError, match="kernels 'amx' are not available here; choose from vector"):
        step.use_kernels("amx")
    with pytest.raises(ValueError, match="kernels 'tiles' are not available here"):
        step.use_kernels("vector", "tiles")
    assert make_step(tiny_weights("fp32"), compiled=False).kernel_choices() == ("reference",)
