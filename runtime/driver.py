"""The rank-0 round loop of speculative decoding.

    engine = SpeculativeEngine(target_runner, target_tokenizer, drafter, SpeculationConfig(...))
    result = engine.generate("Write a prime test.", max_new_tokens=128, sampling=SamplingParams(), chat=True)

One round (ARCHITECTURE.md): the proposer drafts (drafter and tokenizers live here, on rank 0),
`target.forward` runs [last token] + draft on every rank in one tensor-parallel forward (the
runner broadcasts the verify command), the verifier decides, `target.truncate` rolls every
rank back to the accepted length (the runner broadcasts the commit), the proposer brings the
drafter up to date. World size 1 is the same loop with nothing broadcast.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.drafters.load import Drafter
from hetero_run.runtime.drafters.threads import calibrate_threads
from hetero_run.runtime.eagle3 import is_eagle3
from hetero_run.runtime.models.kv_cache import KVCacheFull
from hetero_run.runtime.speculative.adaptive import DraftLength
from hetero_run.runtime.speculative.config import SpeculationConfig
from hetero_run.runtime.speculative.context import DraftContext
from hetero_run.runtime.speculative.factory import candidates, check_algorithm, make_proposer
from hetero_run.runtime.speculative.pairing import Pairing
from hetero_run.runtime.speculative.prompt import Prompt
from hetero_run.runtime.speculative.proposer import DraftSession, NoProposer
from hetero_run.runtime.speculative.retokenize import utf8_complete
from hetero_run.runtime.speculative.round import RoundPlan
from hetero_run.runtime.speculative.selector import Selector
from hetero_run.runtime.speculative.stats import GenerationResult, RoundStats
from hetero_run.runtime.speculative.verifier import RejectionSampler, read_emitted
from hetero_run.topology.errors import UserError

log = logging.getLogger("hetero_run.runtime.driver")


class SpeculativeEngine:
    """Lossless speculative generation on rank 0 over a `TargetRunner`-like target
    (`forward(ids [n], positions [n]) -> logits [n, vocab]`, `truncate(length)`)."""

    def __init__(self, target, target_tokenizer, drafter: Drafter | None = None,
                 config: SpeculationConfig | None = None):
        self.target, self.drafter = target, drafter
        self.config = config or SpeculationConfig(algorithm="auto" if drafter else "none")
        self.pairing = Pairing(target_tokenizer, drafter.tokenizer if drafter else None, self.config.window)
        check_algorithm(self.config.algorithm, drafter is not None, self.pairing.same_vocab, is_eagle3(drafter))
        # what `auto` and the draft lengths measured, kept from prompt to prompt (same pair, same task)
        self.measured: dict[tuple[str, ...], tuple[Selector, dict[str, DraftLength]]] = {}
        self.drafter_threads = None
        if drafter is not None and self.config.algorithm != "none":
            threads = self.config.drafter_threads
            self.drafter_threads = threads or calibrate_threads(drafter.model)

    def generate(self, prompt: str | Sequence | Prompt, max_new_tokens: int = 128,
                 sampling: SamplingParams | None = None, chat: bool = False, stop_ids: set[int] | None = None,
                 on_round: Callable[[RoundStats], None] | None = None) -> GenerationResult:
        """Generate up to `max_new_tokens` target tokens (fewer when a stop token comes)."""
        g = _Generation(self, Prompt.of(prompt, chat), sampling or SamplingParams(), stop_ids, max_new_tokens)
        while not g.done:
            name = g.selector.current()
            proposer = g.proposers[name]
            k = g.draft_len(name)
            begin = time.perf_counter()
            try:
                plan = proposer.propose(k, g.position)
            except KVCacheFull as e:  # the drafter's cache: the target alone finishes the text
                g.stop_drafting(e)
                continue
            drafted = time.perf_counter()
            ids, positions = plan.target_inputs(g.last_token)
            emitted = read_emitted(g.verifier(plan, self.target.forward(ids, positions)))  # one host sync
            self.target.truncate(g.position + len(emitted))
            verified = time.perf_counter()
            kept = proposer.commit(plan, emitted)
            g.record(name, k, plan, emitted, kept, verified - drafted, time.perf_counter() - verified + drafted - begin,
                     on_round)
        return g.result()


class _Generation:
    """One generate() call: prompts rendered, both models prefilled, per-round bookkeeping."""

    def __init__(self, engine: SpeculativeEngine, prompt: Prompt, sampling: SamplingParams,
                 stop_ids: set[int] | None, max_new_tokens: int):
        self.engine, self.config, self.max_new_tokens = engine, engine.config, max_new_tokens
        pairing, target = engine.pairing, engine.target
        self.stop_ids = pairing.stop_ids() if stop_ids is None else set(stop_ids)
        self.start = time.perf_counter()
        self.target_ids = prompt.for_target(pairing.target_tokenizer)
        self.prompt_tokens = len(self.target_ids)
        if not self.target_ids:
            raise UserError("the prompt is empty", field="prompt")
        generator = None if sampling.greedy else sampling.generator()
        self.verifier = RejectionSampler(sampling, generator)
        target.truncate(0)
        n = self.prompt_tokens
        # the prompt's last row only, exactly as the target alone computes it
        logits = target.forward(torch.tensor(self.target_ids, dtype=torch.long), torch.arange(n), num_logits=1)
        context = None
        if engine.drafter is not None and self.config.algorithm != "none":
            context = DraftContext(engine.drafter.model, pairing.drafter_retokenizer,
                                   prompt.for_drafter(pairing.drafter_tokenizer, pairing.target_tokenizer),
                                   pairing.same_vocab, engine.drafter_threads)
        self.session = DraftSession(pairing, context, self.target_ids, logits.shape[-1], sampling, generator)
        names = self._algorithms(sampling)
        self.proposers = {n: make_proposer(n, self.session, self.config) for n in names}
        self.proposers.setdefault("none", NoProposer(self.session, self.config))
        self.selector, self.lengths = self._measurements(names)
        self.position = n  # target position of the next token; the KV cache holds the prompt
        self.token_ids: list[int] = []
        self.algorithms: list[str] = []
        self.draft_lengths: list[int] = []
        self.drafted = self.accepted = 0
        self.draft_seconds = self.verify_seconds = 0.0
        self.stop_reason = "length"
        first = read_emitted(self.verifier(RoundPlan(torch.empty(0, dtype=torch.long), None, n - 1), logits))
        self.proposers["none"].commit(RoundPlan(torch.empty(0, dtype=torch.long), None, n), first)
        if context is not None:
            context.catch_up()  # the drafter's prompt runs now, not inside the first measured round
        self.prefill_seconds = time.perf_counter() - self.start
        self.decode_start = time.perf_counter()
        kept = self._append(first)
        self.pending_ids = kept  # the prompt forward's token: streamed with the first round's
        self.pending_text = pairing.target_table.decode(kept)
        self.position = n

    def _measurements(self, names: list[str]) -> tuple[Selector, dict[str, DraftLength]]:
        """The engine's selector and draft lengths for these candidates, made on first use."""
        key = tuple(names)
        if key not in self.engine.measured:
            self.engine.measured[key] = (Selector(names, self.config, auto=self.config.algorithm == "auto"),
                                         {n: DraftLength(self.config, n) for n in self.proposers})
        selector, lengths = self.engine.measured[key]
        selector.counting = False  # this prompt's first round catches the drafter up: not measured
        return selector, lengths

    def _algorithms(self, sampling: SamplingParams) -> list[str]:
        config, pairing = self.config, self.engine.pairing
        if config.algorithm != "auto":
            return [config.algorithm]
        return candidates(self.engine.drafter is not None, pairing.same_vocab, sampling.greedy,
                          is_eagle3(self.engine.drafter))

    @property
    def last_token(self) -> int:
        return self.target_ids[-1]

    @property
    def done(self) -> bool:
        return self.stop_reason == "stop_token" or len(self.token_ids) >= self.max_new_tokens

    def _append(self, emitted: list[int]) -> list[int]:
        """Add emitted tokens, cut at a stop token or the length limit; -> what was kept."""
        room = self.max_new_tokens - len(self.token_ids)
        kept = emitted[:room]
        for i, token in enumerate(kept):
            if token in self.stop_ids:
                kept = kept[: i + 1]
                self.stop_reason = "stop_token"
                break
        self.token_ids += kept
        self.target_ids += kept
        return kept

    def stop_drafting(self, reason: Exception) -> None:
        log.warning("drafting stops for the rest of this generation: %s", reason)
        self.session.context = None
        self.selector = Selector(["none"], self.config, auto=False)

    def draft_len(self, name: str) -> int:
        """This round's k, within what the target's KV cache still holds."""
        if name == "none":
            return 0
        k = self.lengths[name].next()
        room = getattr(self.engine.target, "max_tokens", None)
        if room is not None:
            k = max(0, min(k, room - self.position - 1 - self.config.max_target_draft * (name == "slem")))
        return k

    def record(self, name: str, k: int, plan: RoundPlan, emitted: list[int], kept_units: int, verify_s: float,
               draft_s: float, on_round) -> None:
        self.position += len(emitted)
        kept = self._append(emitted)
        self.lengths[name].record(k, kept_units, plan.k + 1, len(emitted), draft_s, verify_s)
        self.selector.record(name, len(emitted), draft_s + verify_s)
        self.drafted += plan.k
        self.accepted += len(emitted) - 1
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s
        self.algorithms.append(name)
        self.draft_lengths.append(k)
        if on_round is not None:
            on_round(self._round_stats(name, k, plan, emitted, kept))

    def _round_stats(self, name: str, k: int, plan: RoundPlan, emitted: list[int], kept: list[int]) -> RoundStats:
        data = self.pending_text + self.engine.pairing.target_table.decode(kept)
        complete = utf8_complete(data)
        self.pending_text = data[complete:]
        kept, self.pending_ids = self.pending_ids + kept, []
        return RoundStats(len(self.algorithms), name, k, plan.k, len(emitted) - 1, kept,
                          data[:complete].decode("utf-8", "replace"), len(self.token_ids),
                          time.perf_counter() - self.start, self.accepted / max(1, self.drafted),
                          len(self.token_ids) / len(self.algorithms))

    def result(self) -> GenerationResult:
        counters = {}
        for name, proposer in self.proposers.items():
            counters.update({f"{name}_{key}": value for key, value in getattr(proposer, "counters", {}).items()})
        text = self.engine.pairing.target_tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return GenerationResult(
            self.token_ids, text, self.prompt_tokens, len(self.algorithms), self.drafted, self.accepted,
            time.perf_counter() - self.start, self.prefill_seconds, self.draft_seconds, self.verify_seconds,
            self.config.algorithm, self.algorithms, self.draft_lengths, counters, self.stop_reason,
        )
