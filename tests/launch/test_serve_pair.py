"""`hetero-run serve` on the real CPU pair under `mpirun -np 2`: the openai client's greedy chat,
streamed and not, equals `hetero-run generate --json --chat` token for token, and the real target
calls an offered tool (slow)."""

from __future__ import annotations

import json
import subprocess

import pytest
from serve_support import API_KEY, start_server, stop_server
from support import PAIR, env_for_tests, hetero_run_argv, mpirun_argv

TARGET = PAIR / "qwen2.5-coder-0.5b-instruct-nvfp4"
DRAFTER = PAIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write a Python function that checks whether a number is prime."
FLAGS = ("--algorithm", "slem", "--context", "2048")

pytestmark = [pytest.mark.slow, pytest.mark.mpi,
              pytest.mark.skipif(not (TARGET.is_dir() and DRAFTER.is_file()), reason="the real pair is not fetched")]


def test_real_pair_chat_equals_generate(tmp_path):
    argv = mpirun_argv(2) + hetero_run_argv() + [
        "generate", "--target", str(TARGET), "--drafter", str(DRAFTER), *FLAGS, "--prompt", PROMPT, "--chat", "--json",
        "--max-new-tokens", "48"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env_for_tests())
    assert proc.returncode == 0, proc.stderr
    (ref,) = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    server = start_server(TARGET, DRAFTER, tmp_path, *FLAGS, "--dtype", "auto", "--api-key", API_KEY, timeout=600)
    try:
        client = server.client(timeout=600)
        messages = [{"role": "user", "content": PROMPT}]
        out = client.chat.completions.create(model=TARGET.name, messages=messages, max_tokens=48, temperature=0,
                                             extra_body={"return_token_ids": True})
        assert out.choices[0].token_ids == ref["token_ids"] and out.choices[0].message.content == ref["text"]
        assert out.usage.prompt_tokens == ref["prompt_tokens"]
        spec = out.model_extra["speculation"]
        assert spec["algorithm"] == "slem" and spec["accepted_tokens"] > 0, spec
        chunks = list(client.chat.completions.create(model=TARGET.name, messages=messages, max_tokens=48,
                                                     temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref["text"]
        assert "def " in ref["text"]
        weather = {"type": "function", "function": {
            "name": "get_weather", "description": "Get the current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        asked = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
        out = client.chat.completions.create(model=TARGET.name, messages=asked, tools=[weather], max_tokens=48,
                                             temperature=0)
        (call,) = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    finally:
        stop_server(server)


def test_real_pair_log_probabilities_under_speculation_are_the_target_alones(tmp_path):
    """TP=2: every log-probability entry (token, figure, bytes, top 5) of the slem server equals the
    server without speculation, for the answer and, with echo, for the prompt."""
    servers = {}
    try:
        for name, drafter, flags in (("slem", DRAFTER, FLAGS), ("none", None, ("--algorithm", "none", "--context",
                                                                                 "2048"))):
            servers[name] = start_server(TARGET, drafter, tmp_path / name, *flags, "--dtype", "auto",
                                         "--api-key", API_KEY, timeout=600)
        answers = {}
        for name, server in servers.items():
            client = server.client(timeout=600)
            chat = client.chat.completions.create(model=TARGET.name, messages=[{"role": "user", "content": PROMPT}],
                                                  max_tokens=48, temperature=0, logprobs=True, top_logprobs=5)
            text = client.completions.create(model=TARGET.name, prompt="def fibonacci(n):", max_tokens=32,
                                             temperature=0, logprobs=5, echo=True)
            answers[name] = (chat.choices[0].logprobs.model_dump(), text.choices[0].logprobs.model_dump(),
                             chat.model_extra["speculation"])
        assert answers["slem"][:2] == answers["none"][:2]
        assert answers["slem"][2]["accepted_tokens"] > 0 and answers["none"][2]["draft_tokens"] == 0
        assert len(answers["none"][0]["content"]) == 48
    finally:
        for server in servers.values():
            stop_server(server)
