"""Turning logits into the distribution a sampler draws from, and drawing from it.

The processed distribution is *the* target distribution p of a sampled run: speculative
verification compares draft tokens against exactly what `logits_to_probs` returns, so
temperature, top-k and top-p are applied in one place only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero_run.kernels import cpu_ext
from hetero_run.topology.errors import ConfigError

NUCLEUS_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f"must be >= 0, got {self.temperature}", field="temperature")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.top_p}", field="top_p")
        if self.top_k < 0:
            raise ConfigError(f"must be >= 0, got {self.top_k}", field="top_k")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else torch.seed())
        return gen


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature, top-k, top-p.

    Greedy params give a one-hot distribution on the argmax, so verifiers can treat greedy
    as the temperature -> 0 limit of sampling.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax_rows(logits), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix (most probable first) whose mass reaches top_p: a token stays if
    the mass strictly before it is below top_p. E.g. [0.5, 0.3, 0.2] with top_p 0.7 keeps 0.5
    and 0.3. The nucleus is found among the NUCLEUS_CANDIDATES most probable tokens (a partial
    top-k, ~15x cheaper than sorting a 152k vocabulary); only when the last of them would still
    be kept does it sort the whole row, so the result is the same either way."""
    k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    values, order = torch.topk(probs, k, dim=-1)  # [n, k], descending
    before = values.cumsum(-1) - values
    if k < probs.shape[-1] and bool((before[..., -1] < top_p).any()):
        values, order = torch.sort(probs, dim=-1, descending=True)
        before = values.cumsum(-1) - values
    values = values.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, values)
    return kept / kept.sum(-1, keepdim=True)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[n, vocab] -> [n] int64, exactly torch.argmax(x, -1): the compiled scan for float32 rows on
    the CPU (PyTorch's CPU argmax reads a 152k vocabulary at about 2 GB/s, 0.26 ms a row, and a
    greedy verify reads one per row), PyTorch otherwise."""
    lib = cpu_ext.ops()
    if lib is not None and x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
        return lib.row_argmax(x)
    return x.argmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[n, vocab] probabilities -> [n] token ids (argmax when `generator` is None)."""
    if generator is None:
        return argmax_rows(probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def keyed_noise(seed: int, position: int, vocab: int, device=None) -> torch.Tensor:
    """[vocab] independent Exp(1) draws that depend only on (seed, position): the randomness of
    the token at one position of one seeded request, however and with whatever else it is
    decided. Token v wins the race argmax p_v / noise_v with probability exactly p_v (the
    exponential race, the Gumbel-max trick in another form), so `sample_keyed` draws from p."""
    generator = torch.Generator(device=device or "cpu")
    generator.manual_seed((seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) % (1 << 63))
    uniform = torch.rand(vocab, generator=generator, device=device)
    return -torch.log1p(-uniform)  # Exp(1); 1 - u is never 0


def sample_keyed(probs: torch.Tensor, seed: int, positions: list[int] | torch.Tensor,
                 ids: torch.Tensor | None = None, vocab: int | None = None) -> torch.Tensor:
    """probs [n, m] -> [n] draws, row i with the noise of (seed, positions[i]). `ids` [m] names
    the target token each column stands for (a drafter's probabilities over part of the target's
    vocabulary), so a drafter and the target racing over the same noise agree as often as their
    distributions let them; by default column v is token v. `vocab`: the target's vocabulary
    width, the noise's (default m): whoever races at a position must draw the same vector.
    Returns column indices."""
    out = []
    width = vocab if vocab is not None else probs.shape[-1]
    if ids is not None and ids.numel() and int(ids.max()) >= width:
        raise ValueError(f"column ids up to {int(ids.max())} outside the vocabulary of {width}")
    for row, position in zip(probs, positions.tolist() if torch.is_tensor(positions) else positions, strict=True):
        noise = keyed_noise(seed, int(position), width, row.device)
        if ids is not None:
            noise = noise[ids]
        out.append(torch.argmax(row / noise))
    return torch.stack(out) if out else torch.empty(0, dtype=torch.long)
