"""Tiny tokenizers and models for the speculative tests, built in the test process.

Three tokenizers with genuinely different conventions, trained with the `tokenizers` library:
- `byte_level`: GPT-2 style byte-level BPE (space is `Ġ`, every byte is a token), Qwen-like
  specials and chat template — the target's tokenizer;
- `sentencepiece`: `▁` for space, byte fallback (`<0xE4>`), a BOS the post-processor inserts,
  a different chat template;
- `trailing_space`: spaces merged onto the previous word (`hello▁`), no byte fallback: text
  it cannot spell becomes `<unk>`.
Models are random Llama / Qwen2 networks over those vocabularies; `HFTarget` drives one through
the target-runner interface (`forward(ids, positions) -> logits`, `truncate(length)`).
"""

from __future__ import annotations

import functools
import json

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from hetero_run.runtime.drafters.hf import cache_argument

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, n):\n        if n % i == 0:\n"
    "            return False\n    return True\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Hello world! Hello there, how are you doing today? I am doing well, thank you.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "naïve café résumé — 你好, 世界! 😀 emoji and accents are rare.",
    "for x in range(10):\n    print(x * x)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
] * 4

QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INST_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def _wrap(tok: Tokenizer, **special) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


@functools.cache
def byte_level(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    out = _wrap(tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    out.chat_template = QWEN_TEMPLATE
    return out


@functools.cache
def sentencepiece(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    alphabet = sorted({c for text in CORPUS for c in text.replace(" ", "\u2581") if ord(c) < 0x3000})
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=alphabet,
        limit_alphabet=len(alphabet), show_progress=False))
    # Byte-fallback tokens live in the model's vocabulary, as in SentencePiece conversions.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["model"]["fuse_unk"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out = _wrap(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    out.chat_template = INST_TEMPLATE
    return out


@functools.cache
def trailing_space(vocab_size: int = 250) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse()])
    alphabet = sorted({c for text in CORPUS for c in text.replace(" ", "\u2581") if ord(c) < 0x3000})
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<bos>", "<eos>"], initial_alphabet=alphabet,
        limit_alphabet=len(alphabet), show_progress=False))
    return _wrap(tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


TOKENIZERS = {"byte_level": byte_level, "sentencepiece": sentencepiece, "trailing_space": trailing_space}


def tiny_model(tokenizer, arch: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64):
    """A random causal LM over the tokenizer's ids (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = max(tokenizer.get_vocab().values()) + 1
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Sharper logits than the default init, so greedy choices are stable and drafts can match.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


class HFTarget:
    """The target-runner interface over a transformers model (tests only).

    forward(target_ids [n], positions [n]) -> logits [n, vocab] appends to the KV cache;
    truncate(length) crops it.
    """

    def __init__(self, model):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache()
        self.length = 0
        self.calls = 0

    @torch.inference_mode()
    def forward(self, target_ids: torch.Tensor, positions: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        assert int(positions[0]) == self.length, (int(positions[0]), self.length)
        out = self.model(input_ids=target_ids[None], position_ids=positions[None], use_cache=True,
                         **{cache_argument(self.model): self.cache})
        self.length += target_ids.numel()
        self.calls += 1
        return out.logits[0, -(num_logits or target_ids.numel()):].float()

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.cache.crop(length - self.length)
        self.length = length


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int] = frozenset()) -> list[int]:
    """Target-alone greedy decoding with a plain loop: the reference every algorithm must equal."""
    runner = HFTarget(model)
    ids = list(prompt_ids)
    logits = runner.forward(torch.tensor(ids), torch.arange(len(ids)))
    out = []
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        if token in eos_ids:
            break
        logits = runner.forward(torch.tensor([token]), torch.tensor([runner.length]))
    return out


def trained_model(tokenizer, arch: str = "llama", seed: int = 0, steps: int = 60):
    """A tiny model trained briefly on CORPUS, so that a target and a drafter trained on the same
    text agree often (drafts get accepted) but not always."""
    model = tiny_model(tokenizer, arch, seed).train()
    with torch.no_grad():
        model.lm_head.weight.div_(8.0)
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in CORPUS[: len(CORPUS) // 4]]
    width = max(len(x) for x in ids)
    batch = torch.tensor([x + [0] * (width - len(x)) for x in ids])
    labels = torch.tensor([x + [-100] * (width - len(x)) for x in ids])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead
    torch.manual_seed(seed)
    try:
        for _ in range(steps):
            loss = model(input_ids=batch, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


class PairLM:
    """A language model whose next-token logits depend on the last two tokens only:
    logits(prev, cur) = a[cur] + b[prev]. Cheap enough for thousands of sampled generations,
    and usable both as the target runner and as a drafter model (chains and trees)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b = a, b  # [vocab, vocab] each
        self.vocab_size = a.shape[0]
        self.tokens: list[int] = []
        self.tree: list[tuple[int, int]] | None = None  # (token, parent) since the tree opened
        self.tree_base = 0

    @property
    def length(self) -> int:
        return len(self.tokens) + (len(self.tree) if self.tree is not None else 0)

    def _row(self, prev: int, cur: int) -> torch.Tensor:
        return self.a[cur] + (self.b[prev] if prev >= 0 else 0)

    def forward(self, ids, positions_or_parents=None, head=None, num_logits=None, last=False):
        ids = ids.tolist()
        num_logits = 1 if last else num_logits
        is_tree = positions_or_parents is not None and self._is_parents(positions_or_parents)
        rows = []
        if is_tree:
            if self.tree is None:
                self.tree, self.tree_base = [], len(self.tokens)
            for token, parent in zip(ids, positions_or_parents.tolist(), strict=True):
                prev = self.tree[parent][0] if parent >= 0 else (self.tokens[-1] if self.tokens else -1)
                self.tree.append((token, parent))
                rows.append(self._row(prev, token))
        else:
            assert self.tree is None
            for token in ids:
                rows.append(self._row(self.tokens[-1] if self.tokens else -1, token))
                self.tokens.append(token)
        logits = torch.stack(rows)
        if head is not None:
            logits = logits[:, head]
        return logits[-num_logits:] if num_logits else logits

    def _is_parents(self, t) -> bool:
        return self._tree_calls

    def truncate(self, length: int) -> None:
        if self.tree is not None:
            chain = []
            for i, (token, parent) in enumerate(self.tree):
                if parent != i - 1:
                    break
                chain.append(token)
            self.tokens += chain
            self.tree = None
        assert length <= len(self.tokens), (length, len(self.tokens))
        del self.tokens[length:]

    def prune_head(self, rows: torch.Tensor) -> torch.Tensor:
        return rows


class PairDrafter(PairLM):
    _tree_calls = True  # the second positional argument of forward is `parents`


class PairTarget(PairLM):
    _tree_calls = False  # the second positional argument of forward is `positions`


def restricted_pair_lm(tokenizer, alphabet: str, seed: int, cls=PairDrafter, spread: float = 1.5,
                       first: int | None = None):
    """A PairLM over `tokenizer` whose probability stays on tokens spelled with `alphabet` (the
    rest get -inf): in effect a tiny vocabulary inside a real tokenizer. `first`: a token that
    every context starting a generation prefers strongly (fixes the first generated token)."""
    vocab = max(tokenizer.get_vocab().values()) + 1
    from hetero_run.runtime.speculative.vocab import TokenTable

    pieces = TokenTable.from_tokenizer(tokenizer).pieces
    allowed = torch.tensor([bool(p) and all(chr(c) in alphabet for c in p) for p in pieces] +
                           [False] * (vocab - len(pieces)))
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(vocab, vocab, generator=gen) * spread
    b = torch.randn(vocab, vocab, generator=gen) * spread * 0.5
    a[:, ~allowed] = float("-inf")
    return cls(a, b), allowed


class TreePairTarget(PairLM):
    """A PairLM target that also verifies trees, with the interface the runner will have:
    forward(ids, positions, num_logits=None, parents=None) -> logits for every row (row i's
    from its parent row's token and its own, exactly what decoding that path gives), then
    keep(rows) keeps row 0 and the accepted path as the cache's continuation."""

    _tree_calls = False

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        super().__init__(a, b)
        self.pending: list[int] | None = None
        self.tree_forwards = 0

    def forward(self, ids, positions=None, num_logits=None, parents=None):
        if parents is None:
            return super().forward(ids, positions, num_logits=num_logits)
        ids = ids.tolist()
        assert parents[0] == -1 and all(p < i for i, p in enumerate(parents))
        rows = []
        for token, parent in zip(ids, parents, strict=True):
            prev = ids[parent] if parent >= 0 else (self.tokens[-1] if self.tokens else -1)
            rows.append(self._row(prev, token))
        self.pending = ids
        self.tree_forwards += 1
        return torch.stack(rows)

    def keep(self, rows: list[int]) -> None:
        assert self.pending is not None and rows[0] == 0, rows
        self.tokens += [self.pending[r] for r in rows]
        self.pending = None


class TreeCounter:
    """The real runner (trees verified by its own paged attention), counting tree forwards."""

    def __init__(self, target):
        self.target = target
        self.tree_forwards = 0

    @property
    def max_tokens(self) -> int:
        return self.target.max_tokens

    @property
    def length(self) -> int:
        return self.target.length

    def forward(self, ids, positions, num_logits=None, parents=None):
        self.tree_forwards += parents is not None
        return self.target.forward(ids, positions, num_logits, parents)

    def keep(self, rows: list[int]) -> None:
        self.target.keep(rows)

    def truncate(self, length: int) -> None:
        self.target.truncate(length)


class ChainsOnly:
    """A target that verifies chains only (no `parents`, no `keep`): tree rounds fall back to chains."""

    def __init__(self, target):
        self.target = target

    @property
    def max_tokens(self) -> int:
        return self.target.max_tokens

    @property
    def length(self) -> int:
        return self.target.length

    def forward(self, ids, positions, num_logits=None):
        return self.target.forward(ids, positions, num_logits)

    def truncate(self, length: int) -> None:
        self.target.truncate(length)
