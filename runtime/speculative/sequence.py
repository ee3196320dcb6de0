"""One sequence's speculative decoding, round by round, with the target forward left to the caller.

    seq = SpeculativeSequence(engine, prompt, sampling, verifier, stop_ids, max_new_tokens)
    ids, positions = seq.prefill_inputs();  seq.start(target.forward(ids, positions, num_logits=1))
    while not seq.done:
        plan = seq.propose()                                  # drafter and model-free proposers
        ids, positions, parents = plan.target_inputs(seq.last_token)
        verdict = seq.verify(target.forward(ids, positions[, parents]))
        target.truncate(plan.start + len(verdict.rows))  or  target.keep(verdict.rows)
        seq.commit(verdict, seconds)
    result = seq.result()

Everything per sequence lives here (its tokens, drafter view, prompt-lookup index, suffix
state, random stream); what a process learns for all its sequences (the cost model, draft
lengths, the shared suffix cache) lives with the engine. So a batching engine runs the forwards
of many sequences together and calls the same four steps on each.

Each round follows the sequence's policy:
- `none`: the target alone;
- a drafter algorithm (slem, tli, ...): its chain, k from `adaptive.DraftLength`; with
  `hybrid`, merged with the model-free candidates the cost model keeps (tree or best chain);
- `ngram` / `suffix`: model-free candidates only, as many as the cost model finds worth it;
- `auto`: the cost model (`cost.py`) picks none, model-free, the drafter or the hybrid and
  their sizes, every round; every decision is in the debug log.
"""

from __future__ import annotations

import logging
import time

import torch

from hetero_run.runtime.models.kv_cache import KVCacheFull
from hetero_run.runtime.speculative.context import DraftContext
from hetero_run.runtime.speculative.cost import Choice, reach_order
from hetero_run.runtime.speculative.factory import make_proposer, model_algorithm
from hetero_run.runtime.speculative.modelfree import ModelFree
from hetero_run.runtime.speculative.proposer import DraftSession, NoProposer
from hetero_run.runtime.speculative.retokenize import utf8_complete
from hetero_run.runtime.speculative.round import RoundPlan, Verdict
from hetero_run.runtime.speculative.stats import GenerationResult, RoundStats
from hetero_run.runtime.speculative.tree import MODEL, SOURCE_NAMES, DraftTree
from hetero_run.topology.errors import UserError

log = logging.getLogger("hetero_run.runtime.speculative.sequence")


class SpeculativeSequence:
    def __init__(self, engine, prompt, sampling, verifier, stop_ids: set[int] | None, max_new_tokens: int,
                 drafter_model=None):
        """`drafter_model`: this sequence's view of the drafter (a batching engine gives each
        sequence a slot of its own; False: none free, so no drafting); None: the engine's drafter."""
        self.engine, self.config, self.max_new_tokens = engine, engine.config, max_new_tokens
        self.drafter_model = drafter_model
        self.room_cap: int | None = None  # rows the next round may verify, set by a batching engine
        # what n verify rows cost this sequence in the coming step, set by a batching engine (its
        # share of the step); None: the cost model's own figures for forwards of n rows
        self.verify_estimate = None
        self.drafts_can_pay = True  # False: a batching engine found no draft could pay this step (adaptive rounds skip)
        pairing = engine.pairing
        self.sampling, self.verifier = sampling, verifier
        self.generator = verifier.generator
        self.stop_ids = pairing.stop_ids() if stop_ids is None else set(stop_ids)
        self.prompt = prompt
        self.begin = time.perf_counter()
        self.target_ids = prompt.for_target(pairing.target_tokenizer)
        self.prompt_tokens = len(self.target_ids)
        if not self.target_ids:
            raise UserError("the prompt is empty", field="prompt")
        self.token_ids: list[int] = []
        self.labels: list[str] = []
        self.draft_lengths: list[int] = []
        self.drafted = self.accepted = 0
        self.draft_seconds = self.verify_seconds = 0.0
        self.stop_reason = "length"
        self.plan: RoundPlan | None = None
        self.unsynced: list[int] = []  # accepted target tokens the drafter has not read yet (auto)
        self.finished = False

    # -- prefill --------------------------------------------------------------------------------
    def prefill_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.prompt_tokens
        return torch.tensor(self.target_ids, dtype=torch.long), torch.arange(n)

    def start(self, logits: torch.Tensor, catch_up: bool = True) -> None:
        """The prompt's last row [1, vocab] (as the target alone computes it): the first token.
        `catch_up=False` leaves the drafter's reading of the prompt to its first draft."""
        engine, config, pairing = self.engine, self.config, self.engine.pairing
        n = self.prompt_tokens
        has_drafter = engine.drafter is not None and self.drafter_model is not False
        self.model_name = config.algorithm if config.algorithm in engine.drafter_algorithms and has_drafter else None
        if config.algorithm == "auto":
            self.model_name = model_algorithm(has_drafter, pairing.same_vocab, self.sampling.greedy, engine.eagle3)
        context = None
        if self.model_name is not None:
            context = DraftContext(self.drafter_model or engine.drafter.model, pairing.drafter_retokenizer,
                                   self.prompt.for_drafter(pairing.drafter_tokenizer, pairing.target_tokenizer),
                                   pairing.same_vocab, engine.drafter_threads)
        self.session = DraftSession(pairing, context, self.target_ids, logits.shape[-1], self.sampling, self.generator,
                                    getattr(self.verifier, "seed", None))
        self.model = make_proposer(self.model_name, self.session, config) if self.model_name else None
        self.none = NoProposer(self.session, config)
        self.modelfree = ModelFree(config.sources, self.target_ids, config, engine.suffix_cache) \
            if config.sources else None
        self.cost, self.lengths = engine.measurements(self.sampling.greedy)
        self.trees = engine.trees and not engine.eagle3  # the head's feature log follows positions: chains
        self.policy = self._policy()
        self.position = n - 1
        first = self.verifier(RoundPlan(torch.empty(0, dtype=torch.long), None, n - 1), logits).token_ids
        self.none.commit(RoundPlan(torch.empty(0, dtype=torch.long), None, n), first)
        if context is not None and self.policy != "auto" and catch_up:
            context.catch_up()  # the drafter's prompt runs now, not inside the first measured round
        # auto: the drafter reads the prompt when the cost model first picks it (catch-up counted)
        self.prefill_seconds = time.perf_counter() - self.begin
        self.position = n  # target position of the next token; the KV cache holds the prompt
        kept = self._append(first)
        if self.modelfree is not None:
            self.modelfree.extend(kept)
        self.pending_ids = kept  # the prompt forward's token: streamed with the first round's
        self.pending_text = pairing.target_table.decode(kept)

    def _policy(self) -> str:
        algorithm = self.config.algorithm
        if algorithm == "auto":
            return "auto"
        if algorithm in ("ngram", "suffix"):
            return "modelfree"
        if self.model is None:
            return "none"
        return "hybrid" if self.config.hybrid else "model"

    # -- one round ------------------------------------------------------------------------------
    @property
    def last_token(self) -> int:
        return self.target_ids[-1]

    @property
    def done(self) -> bool:
        return self.stop_reason == "stop_token" or len(self.token_ids) >= self.max_new_tokens

    def propose(self) -> RoundPlan:
        begin = time.perf_counter()
        self.model_plan, self.k = None, 0
        try:
            self.plan = self._plan()
        except KVCacheFull as e:  # the drafter's cache: the target alone (and model-free) finish the text
            self.stop_drafting(e)
            self.model_plan, self.k = None, 0
            self.plan = self._plan()
        self.round_draft_seconds = time.perf_counter() - begin
        return self.plan

    def _room(self) -> int:
        """Rows this round may verify (row 0 included), within the target's KV cache."""
        room = getattr(self.engine.target, "max_tokens", None)
        rows = self.config.max_verify_rows if self.room_cap is None else min(self.config.max_verify_rows, self.room_cap)
        return rows if room is None else max(1, min(rows, room - self.position))

    def _model_k(self, k: int, room: int) -> int:
        """A drafter length whose target rows fit `room` (slem: its re-tokenised draft is cut to
        the room after drafting, see `_propose`)."""
        if self.model_name == "slem":
            return k if room >= 2 else 0
        return max(0, min(k, room - 1))

    def _propose(self, room: int) -> RoundPlan:
        """The drafter's chain of self.k, its target rows cut to the room (slem's re-tokenised draft
        may hold more target tokens than drafter tokens; its rows are fixed candidates, any prefix
        of them a valid draft)."""
        plan = self.model.propose(self.k, self.position)
        if plan.k > room - 1 and plan.draft_probs is None:
            plan = RoundPlan(plan.draft_target_ids[:room - 1], None, plan.start, plan.extras)
        return plan

    def _plan(self) -> RoundPlan:
        room, policy = self._room(), self.policy
        priced = self.config.adaptive or policy == "auto"  # sized by the cost model, not fixed
        if policy == "none" or room < 2 or (priced and not self.drafts_can_pay):
            return self._label(self._empty(), "none")
        if policy == "model":
            # a chain emits at most one token per row: rows past the length limit would be
            # drafted and verified only to be thrown away
            room = min(room, self.max_new_tokens - len(self.token_ids))
            self.k = self._model_k(self.lengths[self.model_name].next(), room)
            self.model_plan = self._propose(room)
            return self._label(self.model_plan, self.model_name if self.k else "none")
        candidates = self.modelfree.propose(room - 1) if self.modelfree is not None else []
        modelfree = DraftTree()
        for found in candidates:
            found.probs = [self.cost.acceptance.prob(found.source, b, p) for b, p in zip(found.buckets, found.probs,
                                                                                            strict=True)]
            modelfree.add_candidates(found)
        order = reach_order(modelfree) if self.trees else modelfree.best_chain()
        figures = [(modelfree.depth[r], modelfree.reach[r]) for r in order]
        use_model = self.model is not None and policy in ("auto", "hybrid") and self._model_k(1, room) > 0
        k_range = None
        if policy == "hybrid":
            k = self._model_k(self.lengths[self.model_name].next(), room)
            k_range, use_model = (k, k), k > 0
        if policy == "modelfree" and not figures:
            return self._label(self._empty(), "none")
        pending = self.session.context.pending_tokens + len(self.unsynced) if self.session.context is not None else 0
        if priced:
            choice = self.cost.choose(figures, use_model, self.trees, pending, k_range, policy != "modelfree", room,
                                      verify=self.verify_estimate,
                                      remaining=self.max_new_tokens - len(self.token_ids),
                                      generated=len(self.token_ids))
        else:  # fixed sizes: the drafter's k and every model-free candidate that fits
            k = k_range[0] if k_range else 0
            choice = Choice(k, len(figures), 0.0, 1.0, 0)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("round %d: %d model-free nodes, %s -> %s (%.2f tokens expected, %.1f tok/s)",
                      len(self.labels) + 1, len(order), self.cost.summary(self.verify_estimate),
                      choice.label(self.model_name or "drafter"), choice.expected, choice.rate)
        if choice.k:
            self.k = self._model_k(choice.k, room)
            begin = time.perf_counter()
            self._sync_drafter()
            self.model_plan = self._propose(room)
            context = self.session.context
            tokens, seconds = context.last_catch_up if context is not None else (0, 0.0)
            self.cost.record_draft(self.k, time.perf_counter() - begin, tokens, seconds, self.model_plan.k)
        return self._merge(self.model_plan, modelfree, order[:choice.m], room)

    def _sync_drafter(self) -> None:
        """Hand the drafter the text accepted since it last drafted (auto: only when it drafts)."""
        if self.unsynced:
            self.none.commit(self._empty(), self.unsynced)
            self.unsynced = []

    def _empty(self) -> RoundPlan:
        return RoundPlan(torch.empty(0, dtype=torch.long), None, self.position, extras=[])

    def _merge(self, model_plan: RoundPlan | None, modelfree: DraftTree, rows: list[int], room: int) -> RoundPlan:
        """The drafter's chain first, then the chosen model-free rows; one chain when the target
        verifies chains only (sampled with q: the drafter's whole chain, see the verifier)."""
        tree = DraftTree()
        q = model_plan.draft_probs if model_plan is not None else None
        if model_plan is not None and model_plan.k:
            tree.add_model_chain(model_plan.draft_target_ids.tolist(), self.cost.acceptance.prob(MODEL, 0))
        rows = rows[: max(0, room - len(tree))]  # a prefix keeps every row's parent
        tree.graft(modelfree, rows)
        if not self.trees and not tree.is_chain:
            keep_model = q is not None and not self.sampling.greedy
            tree = tree.restricted(tree.model_rows[1:] if keep_model else tree.best_chain())
        if q is not None and len(tree.model_rows) != q.shape[0]:
            q = None  # greedy: the chain left the drafter's; q is not read when greedy
        plan = RoundPlan(torch.tensor(tree.draft_tokens(), dtype=torch.long), q, self.position,
                         extras=model_plan.extras if model_plan is not None else [],
                         parents=None if tree.is_chain else list(tree.parents),
                         model_rows=list(tree.model_rows) if q is not None else None, tree=tree)
        names = [self.model_name] if any(s & MODEL for s in tree.sources) else []
        names += [n for bit, n in SOURCE_NAMES.items() if bit != MODEL and any(s & bit for s in tree.sources)]
        return self._label(plan, "+".join(names) or "none")

    def _label(self, plan: RoundPlan, label: str) -> RoundPlan:
        self.label = label
        return plan

    def verify(self, target_logits: torch.Tensor) -> Verdict:
        """target_logits [rows, vocab] for this round's plan -> what the target keeps."""
        return self.verifier(self.plan, target_logits)

    def commit(self, verdict: Verdict, verify_seconds: float, on_round=None) -> None:
        plan, emitted = self.plan, verdict.token_ids
        begin = time.perf_counter()
        self.position += len(emitted)
        kept = self._append(emitted)
        if self.model_plan is not None:
            units = self.model.commit(self.model_plan, emitted)
        elif self.policy == "auto" and self.session.context is not None:
            self.unsynced += emitted  # the drafter reads it when it next drafts
            units = 0
        else:
            units = self.none.commit(plan, emitted)
        if self.modelfree is not None:
            self.modelfree.extend(kept)
        draft_s = self.round_draft_seconds + time.perf_counter() - begin  # proposing and catching up
        if plan.tree is not None:
            self.cost.acceptance.record(plan.tree.cells, plan.tree.parents, verdict.rows)
        self.cost.record_verify(plan.k + 1, verify_seconds, not plan.is_chain)
        self.cost.record_round(draft_s)
        if self.policy in ("model", "hybrid") and self.model_plan is not None:
            self.lengths[self.model_name].record(self.k, units, self.model_plan.k + 1, len(emitted), draft_s,
                                                 verify_seconds)
        self.drafted += plan.k
        self.accepted += len(emitted) - 1
        self.draft_seconds += draft_s
        self.verify_seconds += verify_seconds
        self.labels.append(self.label)
        self.draft_lengths.append(self.k if self.model_plan is not None else plan.k)
        if on_round is not None:
            on_round(self._round_stats(plan, emitted, kept))
        if self.done:
            self.finish()

    # -- bookkeeping ----------------------------------------------------------------------------
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
        self.model = None
        if self.policy in ("model", "hybrid"):
            self.policy = "none" if self.modelfree is None else "modelfree"

    def finish(self) -> None:
        """The generation is over: the shared suffix cache learns it (once)."""
        if not self.finished and self.modelfree is not None:
            self.modelfree.finish()
        self.finished = True

    def _round_stats(self, plan: RoundPlan, emitted: list[int], kept: list[int]) -> RoundStats:
        data = self.pending_text + self.engine.pairing.target_table.decode(kept)
        complete = utf8_complete(data)
        self.pending_text = data[complete:]
        kept, self.pending_ids = self.pending_ids + kept, []
        return RoundStats(len(self.labels), self.label, self.draft_lengths[-1], plan.k, len(emitted) - 1, kept,
                          data[:complete].decode("utf-8", "replace"), len(self.token_ids),
                          time.perf_counter() - self.begin, self.accepted / max(1, self.drafted),
                          len(self.token_ids) / len(self.labels))

    def result(self) -> GenerationResult:
        self.finish()
        counters = {}
        proposers = {"none": self.none, **({self.model_name: self.model} if self.model is not None else {})}
        for name, proposer in proposers.items():
            counters.update({f"{name}_{key}": value for key, value in getattr(proposer, "counters", {}).items()})
        if self.modelfree is not None:
            counters.update({f"modelfree_{key}": value for key, value in self.modelfree.counters.items()})
        text = self.engine.pairing.target_tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return GenerationResult(
            self.token_ids, text, self.prompt_tokens, len(self.labels), self.drafted, self.accepted,
            time.perf_counter() - self.begin, self.prefill_seconds, self.draft_seconds, self.verify_seconds,
            self.config.algorithm, self.labels, self.draft_lengths, counters, self.stop_reason,
        )
