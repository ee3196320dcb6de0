"""The fast drafter's converted checkpoint: made on the first load of a GGUF file, reused without
transformers afterwards, rebuilt when the source or the cache changes, and refused with a clear
error when a weights file is not what the drafter reads."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from tiny_models import write_tiny_gguf

from hetero_run.runtime.drafters import cache
from hetero_run.runtime.drafters import weights as draft_weights
from hetero_run.runtime.drafters.fast import FastDraftModel
from hetero_run.runtime.drafters.load import load_drafter
from hetero_run.runtime.drafters.weights import DraftWeightsError

IDS = torch.tensor([3, 17, 42, 9, 101, 5])
TEXT = "def add(a, b):\n    return a + b\n"


def logits(drafter) -> torch.Tensor:
    drafter.model.truncate(0)
    return drafter.model.forward(IDS)


def no_transformers_model(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the cached drafter must load without a transformers model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize("weights", ["dense", "nvfp4"])
def test_a_gguf_drafter_converts_once_and_loads_from_its_cache(tmp_path, monkeypatch, weights):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = load_drafter(gguf, weights=weights)
    converted = tmp_path / f"tiny.drafter-{weights}-bf16"
    assert cache.valid(converted, gguf, weights, torch.bfloat16)
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name or ".old-" in p.name]
    manifest = json.loads((converted / cache.MANIFEST).read_text())
    assert manifest["source"]["bytes"] == gguf.stat().st_size and len(manifest["source"]["sha256"]) == 64

    no_transformers_model(monkeypatch)
    again = load_drafter(gguf, weights=weights)
    assert isinstance(again.model, FastDraftModel) and again.name == "tiny.gguf"
    assert draft_weights.kind(again.network.weights) == weights
    assert torch.equal(logits(first), logits(again))
    assert again.tokenizer.get_vocab() == first.tokenizer.get_vocab()
    assert again.tokenizer(TEXT)["input_ids"] == first.tokenizer(TEXT)["input_ids"]
    assert again.tokenizer.decode(IDS) == first.tokenizer.decode(IDS)
    direct = load_drafter(converted, weights=weights)  # the converted directory itself
    assert torch.equal(logits(direct), logits(first))


def test_a_touched_source_keeps_its_cache_and_a_changed_one_is_converted_again(tmp_path, monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    before = logits(load_drafter(gguf))
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))  # same bytes, new mtime
    converted = cache.location(gguf, "dense", torch.bfloat16)
    assert cache.valid(converted, gguf, "dense", torch.bfloat16)
    write_tiny_gguf(gguf, seed=1)  # other weights, same size
    assert not cache.valid(converted, gguf, "dense", torch.bfloat16)
    after = logits(load_drafter(gguf))
    assert not torch.equal(before, after)
    assert torch.equal(after, logits(load_drafter(gguf, cache_root=False)))


def test_a_damaged_cache_is_rebuilt(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    want = logits(load_drafter(gguf))
    converted = cache.location(gguf, "dense", torch.bfloat16)
    weights_file = converted / cache.WEIGHTS_FILE
    weights_file.write_bytes(weights_file.read_bytes()[:1000])  # truncated
    assert not cache.valid(converted, gguf, "dense", torch.bfloat16)
    assert torch.equal(logits(load_drafter(gguf)), want)
    assert cache.valid(converted, gguf, "dense", torch.bfloat16)


def test_cache_root_puts_the_conversion_elsewhere_and_false_writes_nothing(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    gguf = write_tiny_gguf(source / "tiny.gguf")
    elsewhere = tmp_path / "caches"
    load_drafter(gguf, cache_root=elsewhere, dtype=torch.float32)
    made = [p.name for p in elsewhere.iterdir() if not p.name.startswith(".")]  # (and its lock file)
    assert len(made) == 1 and made[0].startswith("tiny.drafter-dense-fp32-")
    load_drafter(gguf, cache_root=False)
    assert sorted(p.name for p in source.iterdir()) == ["tiny.gguf"]


def test_bad_weights_files_name_the_file_and_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    load_drafter(gguf)
    good = cache.location(gguf, "dense", torch.bfloat16) / cache.WEIGHTS_FILE
    with open(good, "rb") as f:  # the metadata, as safetensors stores it
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    tensors = load_file(str(good))

    bad = tmp_path / "bad.safetensors"
    save_file({k: v for k, v in tensors.items() if k != "layers.1.o.weight"}, str(bad), metadata=header)
    with pytest.raises(DraftWeightsError, match=r"bad\.safetensors: layers\.1\.o\.weight: tensor is missing"):
        draft_weights.load(bad)
    save_file({**tensors, "norm": torch.ones(3)}, str(bad), metadata=header)
    with pytest.raises(DraftWeightsError, match=r"norm: shape \[3\], expected \[64\]"):
        draft_weights.load(bad)
    save_file(tensors, str(bad), metadata={**header, "format": "something-else"})
    with pytest.raises(DraftWeightsError, match="not a drafter weights file"):
        draft_weights.load(bad)
    bad.write_bytes(b"not safetensors")
    with pytest.raises(DraftWeightsError, match="not a safetensors file"):
        draft_weights.load(bad)


def test_a_converted_directory_without_its_files_is_a_clear_error(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    load_drafter(gguf)
    copy = tmp_path / "copy"
    shutil.copytree(cache.location(gguf, "dense", torch.bfloat16), copy)
    (copy / cache.WEIGHTS_FILE).unlink()
    with pytest.raises(Exception, match="incomplete converted drafter"):
        load_drafter(copy)


def test_prepare_converts_every_kind_from_one_read_of_the_source(tmp_path, monkeypatch):
    import transformers

    from hetero_run.runtime.drafters.load import prepare_drafter

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    reads = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def counted(*args, **kwargs):
        reads.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", counted)
    made = prepare_drafter(gguf)
    assert {k: s for k, (_, s) in made.items()} == {"dense": "converted", "nvfp4": "converted"} and len(reads) == 1
    again = prepare_drafter(gguf)
    assert {k: s for k, (_, s) in again.items()} == {"dense": "verified", "nvfp4": "verified"} and len(reads) == 1
    for kind, (path, _) in again.items():
        assert path == cache.location(gguf, kind, torch.bfloat16)
        assert torch.equal(logits(load_drafter(gguf, weights=kind)), logits(load_drafter(path)))
