"""`hetero-run generate`: the target alone, on one rank and under real `mpirun -np 2`."""

import json
from pathlib import Path

import pytest
import torch
from support import PAIR
from tiny_models import reference_model, tiny_checkpoint, tiny_tokenizer

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.launch.generate import GenerateConfig, Prompt, TargetOnly, encode, run_prompts
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import TargetRunner

PROMPTS = ["def add(a, b):", "The cat sat on"]
REAL_TARGET = PAIR / "qwen2.5-coder-0.5b-instruct.gguf"


@pytest.fixture(scope="module")
def target():
    return tiny_checkpoint("qwen3", "bf16")


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n\n" for p in PROMPTS))
    return path


def _hf_greedy(path, ids: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = reference_model(path).generate(torch.tensor([ids]), generation_config=config,
                                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def _json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_json_greedy_output_matches_transformers(run_cli, target):
    out = run_cli("generate", "--target", target, "--prompt", PROMPTS[0], "--max-new-tokens", "20", "--json",
                  "--dtype", "fp32", "--ignore-eos")
    assert out.returncode == 0, out.output
    (result,) = _json_lines(out.stdout)
    tokenizer = tiny_tokenizer()
    prompt_ids = tokenizer(PROMPTS[0])["input_ids"]
    assert result["token_ids"] == _hf_greedy(target, prompt_ids, 20)
    assert result["new_tokens"] == 20 and result["prompt_tokens"] == len(prompt_ids)
    assert result["text"] == tokenizer.decode(result["token_ids"], skip_special_tokens=True)
    assert result["prompt"] == PROMPTS[0] and result["algorithm"] == "none" and result["finish_reason"] == "length"
    assert result["seconds"] > 0 and result["tokens_per_second"] == pytest.approx(20 / result["seconds"], rel=1e-3)


@pytest.mark.mpi
def test_same_seed_same_output_at_one_and_two_ranks_and_text_streams_on_rank_0(run_cli, target, prompts_file):
    args = ("generate", "--target", target, "--prompts-file", prompts_file, "--max-new-tokens", "24",
            "--temperature", "0.9", "--top-p", "0.95", "--seed", "11", "--dtype", "fp32", "--ignore-eos")
    one = run_cli(*args, "--json")
    two = run_cli(*args, "--json", np=2)
    text = run_cli(*args, "--embedding-split", "even", np=2)  # who holds the embedding rows changes nothing
    for out in (one, two, text):
        assert out.returncode == 0, out.output
    one, two = _json_lines(one.stdout), _json_lines(two.stdout)
    assert [r["prompt"] for r in one] == PROMPTS
    assert [r["token_ids"] for r in one] == [r["token_ids"] for r in two]
    greedy = run_prompts_in_process(target, temperature=0.0)
    assert [r["token_ids"] for r in one] != greedy  # it really sampled
    assert text.stdout == "".join(r["text"] + "\n" for r in two)  # streamed once, by rank 0
    assert "[rank 1]" not in text.stderr


def run_prompts_in_process(path, temperature: float, stop_ids=frozenset(), max_new: int = 24) -> list[list[int]]:
    model = load_model(path, dtype=torch.float32, max_tokens=64)
    config = GenerateConfig(target=Path(path), sampling=SamplingParams(temperature=temperature, seed=11),
                            max_new_tokens=max_new)
    results = []
    with TargetRunner(model) as runner:
        run_prompts(TargetOnly(runner, config.sampling), tiny_tokenizer(), [Prompt(p, "test") for p in PROMPTS],
                    config, set(stop_ids), model.max_tokens, None, results.append)
    return [r.token_ids for r in results]


def test_generation_stops_after_an_end_of_sequence_token(target):
    full = run_prompts_in_process(target, 0.0)[0]
    stop = full[5]
    stopped = run_prompts_in_process(target, 0.0, stop_ids={stop})[0]
    assert stopped == full[: full.index(stop) + 1]


@pytest.mark.mpi
def test_bad_prompts_line_stops_every_rank_with_one_clear_message(run_cli, target, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    out = run_cli("generate", "--target", target, "--prompts-file", path, np=2, timeout=120)
    assert out.returncode == 2, out.output
    assert f'{path}:2: prompt: expected {{"prompt": "<text>"}}' in out.stderr
    assert "[rank 1] stopping: rank 0 could not read the prompts and tokenizer" in out.stderr
    assert "Traceback" not in out.output and out.stdout == ""


@pytest.mark.parametrize("change,message", [
    ({"--target": "/nonexistent/ckpt"}, "/nonexistent/ckpt: --target: no such checkpoint directory or GGUF file"),
    ({"--context": "8"}, "do not fit the KV cache of 8 tokens; raise --context"),
])
def test_bad_input_is_one_line_and_exit_2(run_cli, target, change, message):
    argv = {"--target": str(target), "--prompt": PROMPTS[0], "--max-new-tokens": "16", **change}
    out = run_cli("generate", *[x for k, v in argv.items() for x in ((k,) if v is None else (k, v))])
    assert out.returncode == 2, out.output
    assert message in out.stderr
    assert "Traceback" not in out.output


@pytest.mark.parametrize("flags,message", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["--top-p", "1.5"], "--top-p: must be in (0, 1], got 1.5"),
    (["--temperature", "-1"], "--temperature: must be >= 0, got -1.0"),
    (["--prefill-chunk", "0"], "--prefill-chunk: must be >= 1, got 0"),
    (["--dtype", "int8"], "--dtype: expected auto, bf16 or fp32, got 'int8'"),
])
def test_bad_values_name_the_flag(target, flags, message):
    from hetero_run.launch.cli import build_parser
    from hetero_run.launch.generate import build_config
    from hetero_run.topology.errors import ConfigError

    args = build_parser().parse_args(["generate", "--target", str(target), "--prompt", "x", *flags])
    with pytest.raises(ConfigError) as info:
        build_config(args)
    assert str(info.value) == message


def test_prompts_file_errors_name_file_and_line(tmp_path):
    from hetero_run.launch.cli import build_parser
    from hetero_run.launch.generate import read_prompts
    from hetero_run.topology.errors import ConfigError

    path = tmp_path / "p.jsonl"
    for text, message in [('{"prompt": "a"}\n\n{"prompt": 3}\n', f'{path}:3: prompt: expected {{"prompt": "<text>"}}'),
                          ('{"prompt": "a"}\nnot json\n', f"{path}:2: not a JSON object: Expecting value"),
                          ("\n\n", f"{path}: holds no prompts")]:
        path.write_text(text)
        args = build_parser().parse_args(["generate", "--target", "x", "--prompts-file", str(path)])
        with pytest.raises(ConfigError) as info:
            read_prompts(args)
        assert str(info.value) == message


def test_chat_template_wraps_the_prompt(target, tmp_path):
    from hetero_run.topology.errors import ConfigError

    tokenizer = tiny_tokenizer()
    with pytest.raises(ConfigError, match="--chat: the target's tokenizer has no chat template"):
        encode(tokenizer, Prompt("hi", "test"), chat=True, target=target)
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    ids = encode(tokenizer, Prompt("hi there", "test"), chat=True, target=target)
    assert tokenizer.decode(ids) == "<user>hi there<assistant>"
    plain = encode(tokenizer, Prompt("hi there", "test"), chat=False, target=target)
    assert plain == tokenizer("hi there")["input_ids"]


@pytest.mark.slow
@pytest.mark.skipif(not REAL_TARGET.is_file(), reason="the real CPU target GGUF is not downloaded")
def test_real_gguf_target_chat_greedy_matches_transformers(run_cli, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    prompt = "Write a Python function that checks whether a number is prime."
    out = run_cli("generate", "--target", REAL_TARGET, "--prompt", prompt, "--chat", "--max-new-tokens", "32",
                  "--json", "--dtype", "fp32", timeout=900)
    assert out.returncode == 0, out.output
    (result,) = _json_lines(out.stdout)
    folder, name = str(REAL_TARGET.parent), REAL_TARGET.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    config = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=[151643, 151645], pad_token_id=151643)
    with torch.no_grad():
        expected = model.generate(ids, generation_config=config, attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
    assert result["token_ids"] == expected.tolist()
    assert "def " in result["text"]
