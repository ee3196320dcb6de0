"""`hetero-run generate --drafter`: speculative generation from the command line, at one rank and
under real `mpirun -np 2`, on tiny trained models whose tokenizers differ."""

from __future__ import annotations

import json

import pytest
import speculative_support as support

PROMPTS = ["def is_prime(n):\n", "The quick brown"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, drafter dir, same-vocabulary drafter dir): a qwen2 target over byte-level BPE,
    llama drafters over a `▁`-space byte-fallback vocabulary and over the target's own."""
    root = tmp_path_factory.mktemp("pair")
    paths = []
    for name, tokenizer, arch, seed in (("target", support.byte_level(), "qwen2", 0),
                                        ("drafter", support.sentencepiece(), "llama", 1),
                                        ("same", support.byte_level(), "llama", 1)):
        support.trained_model(tokenizer, arch, seed=seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths.append(root / name)
    return paths


@pytest.fixture(scope="module")
def references(pair):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    tokenizer = support.byte_level()
    return {p: support.reference_greedy(model, tokenizer(p)["input_ids"], 24) for p in PROMPTS}


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def _json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


COMMON = ("--max-new-tokens", "24", "--dtype", "fp32", "--ignore-eos", "--json", "--compare")


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["slem", "tli"])
def test_tp2_speculative_json_is_the_target_alones_output(run_cli, pair, references, prompts_file, algorithm):
    out = run_cli("generate", "--target", pair[0], "--drafter", pair[1], "--algorithm", algorithm,
                  "--prompts-file", prompts_file, *COMMON, np=2, timeout=300)
    assert out.returncode == 0, out.output
    results = _json_lines(out.stdout)
    assert [r["prompt"] for r in results] == PROMPTS
    for r in results:
        assert r["token_ids"] == references[r["prompt"]], r["prompt"]
        assert r["identical"] is True and r["algorithm"] == algorithm
        assert r["rounds"] >= 1 and 0.0 <= r["acceptance_rate"] <= 1.0
        assert r["tokens_per_round"] == pytest.approx(r["new_tokens"] / r["rounds"], rel=1e-3)
        assert r["speedup"] > 0 and r["target_alone_tokens_per_second"] > 0
    assert sum(r["acceptance_rate"] for r in results) > 0, "drafts must be accepted for the check to mean anything"


def test_auto_with_a_same_vocabulary_drafter_prints_text_and_the_comparison(run_cli, pair, references):
    out = run_cli("generate", "--target", pair[0], "--drafter", pair[2], "--prompt", PROMPTS[0],
                  "--max-new-tokens", "24", "--dtype", "fp32", "--ignore-eos", "--compare")
    assert out.returncode == 0, out.output
    text = support.byte_level().decode(references[PROMPTS[0]], skip_special_tokens=True)
    assert text.strip() in out.stdout
    assert "speed-up" in out.stdout and "identical to the target alone: yes" in out.stdout, out.output
    assert "auto" in out.stdout and "Traceback" not in out.output


def test_a_converted_drafter_directory_is_a_drafter(run_cli, pair, references, tmp_path):
    # what the first load of a GGUF drafter writes, given back as --drafter (planned, then loaded)
    import torch
    from tiny_models import write_tiny_gguf

    from hetero_run.runtime.drafters import cache
    from hetero_run.runtime.drafters.load import load_drafter

    gguf = write_tiny_gguf(tmp_path / "drafter.gguf")
    load_drafter(gguf, dtype=torch.float32, weights="nvfp4")
    converted = cache.location(gguf, "nvfp4", torch.float32)
    out = run_cli("generate", "--target", pair[0], "--drafter", converted, "--algorithm", "slem",
                  "--prompt", PROMPTS[0], *COMMON)
    assert out.returncode == 0, out.output
    (result,) = _json_lines(out.stdout)
    assert result["token_ids"] == references[PROMPTS[0]] and result["identical"] is True
    assert result["rounds_by_algorithm"].get("slem", 0) > 0


@pytest.mark.parametrize("algorithm", ["ngram", "suffix", "auto"])
def test_model_free_algorithms_need_no_drafter(run_cli, pair, references, prompts_file, algorithm):
    out = run_cli("generate", "--target", pair[0], "--algorithm", algorithm, "--prompts-file", prompts_file, *COMMON)
    assert out.returncode == 0, out.output
    results = _json_lines(out.stdout)
    for r in results:
        assert r["token_ids"] == references[r["prompt"]] and r["identical"] is True and r["algorithm"] == algorithm
        assert set(r["rounds_by_algorithm"]) <= {"none", "ngram", "suffix", "ngram+suffix"}


def test_sampled_speculative_output_is_seeded(run_cli, pair):
    runs = [_json_lines(run_cli("generate", "--target", pair[0], "--drafter", pair[1], "--algorithm", "tli",
                                "--prompt", PROMPTS[1], "--max-new-tokens", "16", "--temperature", "0.8",
                                "--top-p", "0.9", "--seed", "7", "--dtype", "fp32", "--ignore-eos", "--json").stdout)
            for _ in range(2)]
    assert runs[0][0]["token_ids"] == runs[1][0]["token_ids"] and len(runs[0][0]["token_ids"]) == 16


@pytest.mark.parametrize("flags, message", [
    (("--algorithm", "slem"), "--drafter: algorithm 'slem' needs a drafter"),
    (("--drafter", "/nonexistent/drafter"), "no such drafter directory or GGUF file"),
    (("--drafter", "DRAFTER", "--draft-len", "0"), "--draft-len"),
    (("--drafter", "DRAFTER", "--algorithm", "standard"), "needs a drafter with the target's vocabulary"),
    (("--algorithm", "ngram", "--prompt-lookup-min", "0"), "--prompt-lookup-min: must be >= 1"),
    (("--algorithm", "ngram", "--prompt-lookup-max", "1"), "--prompt-lookup-max: must be >= prompt_lookup_min"),
    (("--algorithm", "suffix", "--suffix-min-prob", "1.5"), "--suffix-min-prob"),
    (("--algorithm", "suffix", "--suffix-spec-offset", "-1"), "--suffix-spec-offset: must be >= 0"),
    (("--algorithm", "suffix", "--suffix-min-match", "0"), "--suffix-min-match: must be >= 1"),
    (("--drafter", "DRAFTER", "--hybrid"), "--hybrid: hybrid rounds need a drafter algorithm"),
    (("--algorithm", "auto", "--model-free", "lookahead"), "--model-free: unknown model-free proposer"),
])
def test_bad_speculation_flags_are_one_line_errors(run_cli, pair, flags, message):
    flags = [str(pair[1]) if f == "DRAFTER" else f for f in flags]
    out = run_cli("generate", "--target", pair[0], "--prompt", "hi", "--max-new-tokens", "4", "--dtype", "fp32",
                  *flags)
    assert out.returncode == 2, out.output
    assert message in out.stderr and "Traceback" not in out.output, out.output
