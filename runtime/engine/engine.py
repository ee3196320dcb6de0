"""The step loop: many requests share each target forward.

    engine = LLMEngine(runner, tokenizer, EngineConfig(...), drafter=None, speculation=None)
    engine.add(request, sink)
    while engine.has_work():
        engine.step()

One step (ARCHITECTURE.md): `schedule()` picks the sequences and their rows (scheduler.py),
each decoding sequence may add draft rows (speculation.py), one `ForwardBatch` carries every
row to every rank (runner.step), then `postprocess` verifies each sequence's rows, commits what
it keeps, streams its text and finishes the ones that are done. Every row is computed as it
would be alone (kernels/batch_invariance.py), so a request's tokens never depend on what else
ran beside it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from hetero_run.runtime.engine.api import (
    GenerationEvent,
    GenerationRequest,
    Sink,
    SpeculationSummary,
    TokenLogprob,
    Usage,
)
from hetero_run.runtime.engine.blocks import BlockManager
from hetero_run.runtime.engine.output import OutputText
from hetero_run.runtime.engine.scheduler import Scheduled, Scheduler
from hetero_run.runtime.engine.sequence import Sequence, Status
from hetero_run.runtime.engine.speculation import Speculation
from hetero_run.runtime.models.batch import ForwardBatch
from hetero_run.topology.errors import ConfigError, UserError

log = logging.getLogger("hetero_run.runtime.engine")


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8  # sequences in one step
    max_num_batched_tokens: int = 256  # rows in one step (prefill chunks included)
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ConfigError(f"must be >= 1, got {self.max_num_seqs}", field="max_num_seqs")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"must be >= --max-num-seqs ({self.max_num_seqs}), got {self.max_num_batched_tokens}",
                              field="max_num_batched_tokens")


class LLMEngine:
    def __init__(self, runner, tokenizer, config: EngineConfig | None = None, drafter=None, speculation=None):
        self.runner, self.tokenizer = runner, tokenizer
        self.config = config or EngineConfig()
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.speculation = Speculation(runner, tokenizer, drafter, speculation)
        self.max_context = runner.max_tokens
        self.by_id: dict[str, Sequence] = {}
        self.steps = 0
        # K/V moves a tree verify asked for (physical source, destination): they run at the start
        # of the next forward, before it writes anything, so a source block released meanwhile
        # still holds its K/V then
        self._copies: list[tuple[int, int]] = []

    @property
    def algorithm(self) -> str:
        return self.speculation.algorithm

    # -- requests -------------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        """A UserError naming the field when `request` can never run here."""
        n = request.prompt_tokens
        if n == 0:
            raise UserError("the prompt is empty", field="prompt")
        if n + request.max_new_tokens - 1 > self.max_context:  # the last token is never forwarded
            raise UserError(f"the prompt's {n} tokens plus max_tokens {request.max_new_tokens} exceed the context of "
                            f"{self.max_context} tokens", field="max_tokens")
        total = self.blocks.num_blocks * self.blocks.block_size
        if n + request.max_new_tokens - 1 > total:
            raise UserError(f"the prompt's {n} tokens plus max_tokens {request.max_new_tokens} exceed the KV cache "
                            f"of {total} tokens", field="max_tokens")

    def add(self, request: GenerationRequest, sink: Sink) -> Sequence:
        self.check(request)
        seq = Sequence(request, sink, list(request.prompt.target_ids))
        seq.output = OutputText(self._decode, request.stop_strings)
        self.by_id[request.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def cancel(self, request_id: str, why: str | None = None) -> None:
        """The request ends ("abort", with `why` as its error) before the next step; its blocks are freed."""
        seq = self.by_id.get(request_id)
        if seq is not None:
            seq.cancelled, seq.cancel_reason = True, why

    def has_work(self) -> bool:
        return not self.scheduler.idle

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def abort_all(self, reason: str, error: str | None = None) -> None:
        for seq in list(self.by_id.values()):
            self._finish(seq, reason, error)

    # -- one step -------------------------------------------------------------------------

    def step(self) -> None:
        for seq in [s for s in self.by_id.values() if s.cancelled]:
            self._finish(seq, "abort", seq.cancel_reason)
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return
        planned = time.perf_counter()
        rounds = self.speculation.plan(scheduled, self.scheduler)  # rows of the sequences this step decides
        batch, spans, prompt_spans = self._batch(scheduled, rounds)
        begin = time.perf_counter()
        logits = self.runner.step(batch)
        seconds = time.perf_counter() - begin
        self.speculation.measured_forward(batch.rows, seconds)
        emitted = self._postprocess(scheduled, rounds, spans, prompt_spans, logits, seconds)
        if all(item.rows == 1 for item in scheduled):  # decode and verify rows only: what drafts add
            self.speculation.measured_step(batch.rows, time.perf_counter() - planned, emitted)
        self.steps += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d sequences, %d rows (%d of them draft rows), %d tokens, planning %.1f ms, "
                      "forward %.1f ms, step %.1f ms", self.steps, len(scheduled), batch.rows,
                      sum(r.plan.k for r in rounds.values()), emitted, (begin - planned) * 1e3, seconds * 1e3,
                      (time.perf_counter() - planned) * 1e3)

    def _batch(self, scheduled: list[Scheduled], rounds: dict) -> tuple[ForwardBatch, list, dict]:
        """One ForwardBatch: each sequence's pending positions, then its round's draft rows (a
        chain, or a tree whose rows attend to their ancestors); `spans[i]` locates sequence i's
        logits rows (None: a prompt chunk that decides nothing); `prompt_spans[i]` those of the prompt
        positions whose log-probabilities sequence i asked for."""
        ids, positions, seq_index, logical, prefix, logits_rows = [], [], [], [], [], []
        prompt_spans: dict[int, tuple[int, range]] = {}  # i -> (its first logits row, the prompt positions read)
        extra_offsets, extras, tables, spans = [0], [], [], []
        copies, self._copies = self._copies, []
        trees = False
        for i, item in enumerate(scheduled):
            seq, start = item.seq, item.seq.computed
            rows = seq.token_ids[start:start + item.rows]
            pos = list(range(start, start + item.rows))
            r = rounds.get(i)
            parents = None
            if r is not None and r.plan.k:  # the pending token is row 0 of the round's chain or tree
                _, round_positions, parents = r.plan.target_inputs(rows[-1])
                rows = rows + r.plan.draft_target_ids.tolist()
                pos = pos[:-1] + round_positions.tolist()
            first, n = len(ids), len(rows)
            ids += rows
            positions += pos
            seq_index += [i] * n
            logical += list(range(start, start + n))
            if parents is not None:  # rows before the round attend causally; the round's rows their paths
                trees = True
                base = start + item.rows - 1
                prefix += list(range(start + 1, base + 1)) + [base] * (n - item.rows + 1)
                extra_offsets += [len(extras)] * (item.rows - 1)
                paths: list[list[int]] = []
                for j, parent in enumerate(parents):
                    paths.append((paths[parent] if parent >= 0 else []) + [base + j])
                    extras += paths[-1]
                    extra_offsets.append(len(extras))
            else:
                prefix += list(range(start + 1, start + n + 1))
                extra_offsets += [len(extras)] * n
            if seq.prompt_rows_wanted:  # rows of prompt positions not yet read, before the deciding ones
                read = range(max(start, len(seq.prompt_entries)), min(start + item.rows, seq.prompt_len - 1))
                prompt_spans[i] = (len(logits_rows), read)
                logits_rows += [first + q - start for q in read]
            if item.decides:
                wanted = list(range(first + item.rows - 1, first + n))  # the pending token's row, then the drafts'
                spans.append((len(logits_rows), len(wanted)))
                logits_rows += wanted
            else:
                spans.append(None)
            tables.append(seq.table.blocks)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        batch = ForwardBatch(as_long(ids), as_long(positions), as_long(seq_index), as_long(logical), as_long(prefix),
                             table, self.blocks.block_size, as_long(logits_rows),
                             as_long(extra_offsets) if trees else None, as_long(extras) if trees else None,
                             as_long(copies).T.contiguous() if copies else None)
        return batch, spans, prompt_spans

    def _postprocess(self, scheduled: list[Scheduled], rounds: dict, spans: list, prompt_spans: dict, logits,
                     seconds: float) -> int:
        """Verify and commit each sequence's rows; the tokens the step emitted."""
        now = time.monotonic()
        deciding = [i for i, span in enumerate(spans) if span is not None]
        shares = dict(zip(deciding, self.speculation.shares(
            [scheduled[i].rows + (rounds[i].plan.k if i in rounds else 0) for i in deciding], seconds)
            if deciding else [], strict=True))
        draft_rows, kept_tokens, emitted = [], [], 0
        for i, item in enumerate(scheduled):
            seq = item.seq
            if i in prompt_spans:
                self._read_prompt(seq, logits, *prompt_spans[i])
            if spans[i] is None:  # a prefill chunk that does not reach the prompt's end
                seq.computed += item.rows
                self.blocks.commit(seq.table, seq.token_ids, seq.computed)
                continue
            first, count = spans[i]
            rows = logits[first:first + count]
            r = rounds.get(i)
            start = seq.computed + item.rows - 1  # the pending token's position
            seq.rounds += 1
            if r is None:  # the prompt's last row: the first token
                new, kept = self.speculation.first(seq, rows), 1
                picked = [0]
            else:
                verdict, new = self.speculation.verify(seq, r, rows, shares[i])
                picked = verdict.rows  # the row whose logits gave each emitted token
                kept = len(verdict.rows)
                draft_rows.append(r.plan.k)
                kept_tokens.append(kept)
                if not r.plan.is_chain:
                    self._keep_branch(seq, start, verdict.rows)
                if r.plan.k:
                    seq.drafts += 1
                    seq.draft_tokens += r.plan.k
                    seq.accepted_tokens += kept - 1
                    _count_positions(seq.accepted_per_position, kept - 1)
            seq.computed = start + kept  # the pending token and the accepted drafts
            emitted += kept
            self.blocks.shrink(seq.table, seq.computed + 1)
            self.blocks.commit(seq.table, seq.token_ids, seq.computed)
            if seq.first_token_at is None:
                seq.first_token_at = now
            top = seq.request.logprobs
            self._emit(seq, new, None if top is None else token_logprobs(rows, picked[:len(new)], new, top),
                       first=r is None)
        self.speculation.measured_rounds(draft_rows, kept_tokens)
        return emitted

    def _keep_branch(self, seq: Sequence, start: int, rows: list[int]) -> None:
        """A tree verify kept `rows` (row 0, then the accepted path): their K/V move to the positions
        start, start + 1, ..., where decoding that path would have put them."""
        b, blocks = self.blocks.block_size, seq.table.blocks
        for j, row in enumerate(rows):
            if row != j:
                src, dst = start + row, start + j
                self._copies.append((blocks[src // b] * b + src % b, blocks[dst // b] * b + dst % b))

    def _read_prompt(self, seq: Sequence, logits, first: int, positions: range) -> None:
        """Prompt tokens' log-probabilities from the rows of `positions` (logits rows from `first`)."""
        rows = list(range(first, first + len(positions)))
        tokens = [seq.token_ids[q + 1] for q in positions]
        seq.prompt_entries += token_logprobs(logits, rows, tokens, seq.request.prompt_logprobs)

    def _emit(self, seq: Sequence, new: list[int], logprobs: list[TokenLogprob] | None = None,
              first: bool = False) -> None:
        """Stream the tokens the round state appended (cut at a stop token or the length limit
        there), with their log-probabilities where asked; finish at a stop token, a stop string or
        the length limit."""
        request, state = seq.request, seq.speculation
        shown = [j for j, t in enumerate(new) if t not in request.stop_ids]
        marks = None if logprobs is None else [logprobs[j] for j in shown]
        text = seq.output.add([new[j] for j in shown], marks) if shown else ""
        reason = None
        if seq.output.stopped or state.stop_reason == "stop_token":
            reason = "stop"
        elif state.done or seq.generated >= request.max_new_tokens:
            reason = "length"
        released = _placed(seq.output.take())
        prompt = tuple(seq.prompt_entries) if first and request.prompt_logprobs is not None else ()
        if text or new:
            seq.sink(GenerationEvent(request.request_id, text, tuple(new), logprobs=released, prompt_logprobs=prompt))
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.status is Status.FINISHED:
            return
        self.scheduler.finish(seq)
        self.speculation.release(seq)
        self.by_id.pop(seq.request_id, None)
        seq.finish_reason = reason
        rest = seq.output.finish() if reason in ("stop", "length") else ""
        usage = Usage(seq.prompt_len, max(0, seq.generated), seq.cached_tokens)
        summary = SpeculationSummary(self.algorithm, seq.rounds, seq.drafts, seq.draft_tokens, seq.accepted_tokens,
                                     tuple(seq.accepted_per_position))
        seq.sink(GenerationEvent(seq.request_id, rest, (), reason, error, usage, summary, _placed(seq.output.take())))

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """tokens[j]'s log-probability under logits[rows[j]] (the target's row that decided it), and
    the `top` likeliest tokens of that row. Every row is computed as it would be alone, so these
    are the figures the target alone gives for the same tokens, whatever was drafted."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
    if top:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(tokens, chosen, tops, strict=True)]


def _count_positions(counts: list[int], accepted: int) -> None:
    """One round accepted drafts at depths 1..accepted: count each depth."""
    counts.extend([0] * (accepted - len(counts)))
    for j in range(accepted):
        counts[j] += 1


def _placed(released: list) -> tuple[TokenLogprob, ...]:
    return tuple(replace(mark, offset=offset) for offset, mark in released)
