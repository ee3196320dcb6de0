"""A request's output text as tokens arrive: whole characters only, stop strings cut exactly.

    text = OutputText(tokenizer_decode, stop_strings=("\\n\\n",))
    delta = text.add([id1, id2])   # text that can no longer change; "" while a character is unfinished
    text.stopped                   # True once a stop string appeared: generation should end now
    rest = text.finish()           # at the end: what was held back (nothing after a stop string)

Detokenisation is incremental: each `add` decodes only the tokens since the last released text,
plus the tokens of that text as context (a SentencePiece decoder drops a leading space at the
start of a sequence, so a token never decodes alone). U+FFFD at the end of the text is held
back: the last token ended inside a multi-byte character that the next token completes. For byte-level
BPE and SentencePiece vocabularies the released pieces add up to `decode(all ids)`.

Stop strings: generation ends where the first stop string is complete in the text (read
character by character); the output ends just before it. Among stop strings completing at the
same character the longest wins (it starts earliest). Text that could still become the start
of a stop string is held back until it cannot.

    stops ("abc", "bc"): "xa" -> "x" (holds "a"); then "bc" -> "" and stopped: output "x"
    stops ("abcd", "bc"): "xabc" -> "xa" and stopped ("bc" completes first)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Token ids -> text released once it can no longer change (never half a character)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: tokens whose text is all released, decoded again as context
        self.read = 0
        self.partial = 0  # characters released from the tokens after `read` (before an unfinished one)

    def add(self, ids: Sequence[int]) -> str:
        self.ids += ids
        context = len(self.decode(self.ids[self.prefix:self.read]))
        full = self.decode(self.ids[self.prefix:])
        stable = len(full.rstrip(REPLACEMENT))
        new = full[context + self.partial:stable]
        if stable == len(full):
            self.prefix, self.read, self.partial = self.read, len(self.ids), 0
        else:
            self.partial += len(new)
        return new

    def flush(self) -> str:
        """Everything not released yet, an unfinished character included (as U+FFFD)."""
        context = len(self.decode(self.ids[self.prefix:self.read]))
        full = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        new, self.partial = full[context + self.partial:], 0
        return new


class StopStrings:
    """Cuts text at the first stop string; holds back what could still start one."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """New text -> the part safe to release now."""
        if self.stopped:
            return ""
        data = self.held + text
        cut = self._first_stop(data)
        if cut is not None:
            self.stopped, self.held = True, ""
            return data[:cut]
        keep = self._open_suffix(data)
        self.held = data[len(data) - keep:]
        return data[:len(data) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _first_stop(self, data: str) -> int | None:
        """Where the output ends: the start of the stop string whose match ends first."""
        best = None  # (end, start)
        for stop in self.stops:
            start = data.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        return None if best is None else best[1]

    def _open_suffix(self, data: str) -> int:
        """Length of the longest end of `data` that is the beginning of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(data)), longest, -1):
                if data.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class OutputText:
    """Incremental detokenisation followed by stop strings: what one request's client sees.

    Tokens may carry a mark (e.g. their log-probability): `add(ids, marks)` decodes them one at
    a time to learn which characters each one brought, and `take()` hands over, in order, the
    marks of the tokens whose characters have all been released, each with where its text starts
    in the output. At a stop string the tokens with characters before the cut come out, the
    rest never; at the end of an unstopped output every remaining mark comes out."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop_strings: Sequence[str] = ()):
        self.decoder = IncrementalDecoder(decode)
        self.stops = StopStrings(stop_strings)
        self.decoded = 0  # characters the decoder released
        self.shown = 0  # characters released to the client
        self.pending: list[tuple[int, int, object]] = []  # (start, end, mark) of tokens not handed over
        self.released: list[tuple[int, object]] = []

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    def add(self, ids: Sequence[int], marks: Sequence | None = None) -> str:
        if marks is None:
            text = self.decoder.add(ids)
        else:
            pieces = []
            for token, mark in zip(ids, marks, strict=True):
                piece = self.decoder.add([token])
                self.pending.append((self.decoded, self.decoded + len(piece), mark))
                self.decoded += len(piece)
                pieces.append(piece)
            text = "".join(pieces)
        return self._show(self.stops.feed(text), final=self.stops.stopped)

    def finish(self) -> str:
        return self._show(self.stops.feed(self.decoder.flush()) + self.stops.flush(), final=True)

    def take(self) -> list[tuple[int, object]]:
        """(offset of the token's text, mark) of the tokens released since the last call."""
        out, self.released = self.released, []
        return out

    def _show(self, text: str, final: bool) -> str:
        self.shown += len(text)
        keep = []
        for start, end, mark in self.pending:
            if end <= self.shown or (final and (start < self.shown or not self.stops.stopped)):
                self.released.append((start, mark))
            elif not final:
                keep.append((start, end, mark))
        self.pending = keep
        return text
