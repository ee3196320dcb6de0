"""The rank-0 round loop of speculative decoding.

    engine = SpeculativeEngine(target_runner, target_tokenizer, drafter, SpeculationConfig(...))
    result = engine.generate("Write a prime test.", max_new_tokens=128, sampling=SamplingParams(), chat=True)

One round (ARCHITECTURE.md): the sequence proposes (drafter, tokenizers and model-free proposers
live here, on rank 0), `target.forward` runs the round's rows on every rank in one
tensor-parallel forward (the runner broadcasts the verify command; a tree round passes
`parents`), the verifier walks the rows, `target.truncate` (a chain) or `target.keep` (a tree)
keeps the accepted rows on every rank, and the sequence commits. World size 1 is the same loop
with nothing broadcast. The per-sequence work is `speculative.sequence.SpeculativeSequence`;
this loop is all that sits between it and the target.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.drafters.load import Drafter
from hetero_run.runtime.drafters.threads import calibrate_kernels, calibrate_threads, prompt_read_seconds
from hetero_run.runtime.eagle3 import is_eagle3
from hetero_run.runtime.speculative.adaptive import DraftLength
from hetero_run.runtime.speculative.config import MODEL_FREE, SpeculationConfig
from hetero_run.runtime.speculative.cost import CostModel
from hetero_run.runtime.speculative.factory import PROPOSERS, check_algorithm
from hetero_run.runtime.speculative.pairing import Pairing
from hetero_run.runtime.speculative.prompt import Prompt
from hetero_run.runtime.speculative.round import RoundPlan, Verdict
from hetero_run.runtime.speculative.sequence import SpeculativeSequence
from hetero_run.runtime.speculative.stats import GenerationResult, RoundStats
from hetero_run.runtime.speculative.suffix import SuffixCache
from hetero_run.runtime.speculative.verifier import verifier_for


def supports_trees(target) -> bool:
    """Whether the target verifies trees: `forward(..., parents=...)` and `keep(rows)`."""
    if not callable(getattr(target, "keep", None)):
        return False
    try:
        return "parents" in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        return False


class _Lengths(dict):
    def __init__(self, config):
        super().__init__()
        self.config = config

    def __missing__(self, name: str) -> DraftLength:
        self[name] = DraftLength(self.config, name)
        return self[name]


class SpeculativeEngine:
    """Lossless speculative generation on rank 0 over a `TargetRunner`-like target
    (`forward(ids [n], positions [n]) -> logits [n, vocab]`, `truncate(length)`; trees too when
    it has `forward(..., parents=...)` and `keep(rows)`)."""

    drafter_algorithms = tuple(n for n in PROPOSERS if n != "none")

    def __init__(self, target, target_tokenizer, drafter: Drafter | None = None,
                 config: SpeculationConfig | None = None, suffix_cache: SuffixCache | None = None):
        self.target, self.drafter = target, drafter
        self.config = config or SpeculationConfig(algorithm="auto" if drafter else "none")
        self.pairing = Pairing(target_tokenizer, drafter.tokenizer if drafter else None, self.config.window)
        self.eagle3 = is_eagle3(drafter)
        check_algorithm(self.config.algorithm, drafter is not None, self.pairing.same_vocab, self.eagle3)
        self.trees = supports_trees(target)
        # shared by every sequence of this engine: earlier generations (suffix decoding)
        self.suffix_cache = suffix_cache
        if suffix_cache is None and "suffix" in self.config.sources:
            self.suffix_cache = SuffixCache(self.config.suffix_max_generations, self.config.suffix_max_tokens)
        # what the cost model and the draft lengths measured, kept from prompt to prompt (per sampling mode)
        self.measured: dict[bool, tuple[CostModel, _Lengths]] = {}
        self.drafter_threads = None
        self.prompt_read_s = None  # drafter seconds per prompt token, measured here: the cost model's first estimate
        if drafter is not None and self.config.algorithm not in ("none", *MODEL_FREE):
            threads = self.config.drafter_threads
            with drafter.borrowed() as model:
                calibrate_kernels(model)
                if not threads:
                    threads = calibrate_threads(model)
                self.prompt_read_s = prompt_read_seconds(model, threads)
            self.drafter_threads = threads

    def measurements(self, greedy: bool) -> tuple[CostModel, _Lengths]:
        if greedy not in self.measured:
            self.measured[greedy] = (CostModel(self.config, self.prompt_read_s), _Lengths(self.config))
        return self.measured[greedy]

    def sequence(self, prompt: str | Sequence | Prompt, max_new_tokens: int = 128,
                 sampling: SamplingParams | None = None, chat: bool = False,
                 stop_ids: set[int] | None = None, drafter_model=None) -> SpeculativeSequence:
        """One sequence's round state (a batching engine keeps one per running request, each with
        its own `drafter_model`, see SpeculativeSequence)."""
        sampling = sampling or SamplingParams()
        verifier = verifier_for(sampling, self.config.sampled_verification)
        return SpeculativeSequence(self, Prompt.of(prompt, chat), sampling, verifier, stop_ids, max_new_tokens,
                                   drafter_model)

    def generate(self, prompt: str | Sequence | Prompt, max_new_tokens: int = 128,
                 sampling: SamplingParams | None = None, chat: bool = False, stop_ids: set[int] | None = None,
                 on_round: Callable[[RoundStats], None] | None = None) -> GenerationResult:
        """Generate up to `max_new_tokens` target tokens (fewer when a stop token comes)."""
        seq = self.sequence(prompt, max_new_tokens, sampling, chat, stop_ids)
        ids, positions = seq.prefill_inputs()
        self.target.truncate(0)
        seq.start(self.target.forward(ids, positions, num_logits=1))  # the prompt's last row, as the target alone
        while not seq.done:
            plan = seq.propose()
            begin = time.perf_counter()
            verdict = seq.verify(self.forward(plan, seq.last_token))
            self.keep(plan, verdict)
            seq.commit(verdict, time.perf_counter() - begin, on_round)
        return seq.result()

    def forward(self, plan: RoundPlan, last_token: int):
        ids, positions, parents = plan.target_inputs(last_token)
        if parents is None:
            return self.target.forward(ids, positions)
        return self.target.forward(ids, positions, parents=parents)

    def keep(self, plan: RoundPlan, verdict: Verdict) -> None:
        if plan.is_chain:
            self.target.truncate(plan.start + len(verdict.rows))
        else:
            self.target.keep(verdict.rows)
