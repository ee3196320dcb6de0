"""What each token id means as bytes, and how two vocabularies relate.

Heterogeneous speculation compares tokenizers through text, and text is compared as UTF-8
bytes so that the word-initial space markers (`Ġ` in byte-level BPE, `▁` in SentencePiece)
and byte-fallback tokens (`<0xE4>`) all mean the same thing: b" " and b"\\xe4". A token that
ends inside a multi-byte character is just a byte string that is not valid UTF-8 on its own.

Special tokens (`<|im_end|>`, `<bos>`) carry no text: their piece is None, and they relate
across vocabularies only by equal content (both Qwen and SmolLM2 end a turn with `<|im_end|>`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from hetero_run.topology.errors import UserError

_BYTE_FALLBACK_LEN = len("<0x00>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: printable characters stand for themselves, the other bytes
    for the characters from U+0100 on (so b" " is "Ġ" and b"\\n" is "Ċ")."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(0x100 + extra)] = b
            extra += 1
    return chars


def _decoder_kind(tokenizer) -> str:
    """"byte_level", "metaspace" (▁ for space, optional <0xNN> byte fallback) or "generic"."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return "generic"
    state = json.loads(decoder.__getstate__())
    kinds = {d.get("type") for d in state.get("decoders", [state])}
    if "ByteLevel" in kinds:
        return "byte_level"
    replaces_marker = any(d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "\u2581"
                          for d in state.get("decoders", [state]))
    if "Metaspace" in kinds or replaces_marker:
        return "metaspace"
    return "generic"


def _piece(token: str, kind: str, alphabet: dict[str, int], tokenizer) -> bytes | None:
    if kind == "byte_level":
        try:
            return bytes(alphabet[c] for c in token)
        except KeyError:  # not a byte-level string (e.g. a padding entry): unusable as text
            return None
    if kind == "metaspace":
        if len(token) == _BYTE_FALLBACK_LEN and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        return token.replace("\u2581", " ").encode("utf-8")
    return tokenizer.convert_tokens_to_string([token]).encode("utf-8")


@dataclass(eq=False)
class TokenTable:
    """One tokenizer's ids as bytes.

    pieces[id] is the token's bytes, None for special tokens; `specials` maps a special token's
    content to its id; `vocab` is the tokenizer's token-to-id map.
    """

    pieces: list[bytes | None]
    specials: dict[str, int]
    vocab: dict[str, int] = field(repr=False)
    kind: str = "generic"
    byte_ids: dict[int, int] = field(default_factory=dict, repr=False)  # byte value -> its one-byte token

    def __post_init__(self):
        for i, piece in enumerate(self.pieces):
            if piece is not None and len(piece) == 1:
                self.byte_ids.setdefault(piece[0], i)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TokenTable:
        vocab = dict(tokenizer.get_vocab())
        if not vocab:
            raise UserError("the tokenizer has an empty vocabulary", field="tokenizer")
        kind = _decoder_kind(tokenizer)
        alphabet = _byte_level_alphabet()
        pieces: list[bytes | None] = [None] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            pieces[i] = _piece(token, kind, alphabet, tokenizer)
        specials = {}
        for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if added.special:
                pieces[i] = None
                specials[added.content] = i
            else:
                pieces[i] = added.content.encode("utf-8")
        return cls(pieces, specials, vocab, kind)

    def __len__(self) -> int:
        return len(self.pieces)

    def decode(self, ids) -> bytes:
        """Bytes of `ids`; special tokens, and ids past the tokenizer's (a model's padded vocabulary
        rows), contribute nothing."""
        n = len(self.pieces)
        return b"".join(self.pieces[i] or b"" for i in ids if i < n)


def same_vocabulary(a: TokenTable, b: TokenTable) -> bool:
    """True when both tokenizers map every token string to the same id.

    vocab_size alone says nothing: Qwen pads its embedding past the tokenizer, and two
    tokenizers of equal size can number their tokens differently.
    """
    return a.vocab == b.vocab


def special_map(source: TokenTable, target: TokenTable) -> dict[int, int]:
    """source special id -> target special id, for specials with the same content."""
    return {i: target.specials[c] for c, i in source.specials.items() if c in target.specials}


@dataclass(frozen=True)
class Intersection:
    """Tokens both vocabularies share, by equal bytes (the space markers normalised away).

    draft_ids[j] and target_ids[j] are the same token in the two vocabularies. When several
    drafter ids spell the same bytes (a byte-fallback `<0x41>` next to `A`), the lowest id
    stands for them; the pruned drafter head then has one row per shared token.
    """

    draft_ids: torch.Tensor  # [n] int64, increasing
    target_ids: torch.Tensor  # [n] int64
    draft_to_target: dict[int, int]

    def __len__(self) -> int:
        return int(self.draft_ids.numel())

    @classmethod
    def build(cls, draft: TokenTable, target: TokenTable) -> Intersection:
        by_bytes: dict[bytes, int] = {}
        for i, piece in enumerate(target.pieces):
            if piece:  # empty and special tokens are never shared
                by_bytes.setdefault(piece, i)
        pairs: dict[int, int] = {}
        seen: set[int] = set()
        for d, piece in enumerate(draft.pieces):
            t = by_bytes.get(piece) if piece else None
            if t is not None and t not in seen:
                pairs[d] = t
                seen.add(t)
        pairs.update({d: t for d, t in special_map(draft, target).items() if t not in seen})
        order = sorted(pairs)
        return cls(
            torch.tensor(order, dtype=torch.long),
            torch.tensor([pairs[d] for d in order], dtype=torch.long),
            pairs,
        )
