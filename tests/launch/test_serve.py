"""`hetero-run serve` under real `mpirun -np 2` (and as one process), called with the official
`openai` client: outputs equal to `hetero-run generate --json`, streaming, usage, stop strings,
concurrent clients, bad input, a client that disconnects, SIGTERM drain, and rank 1 killed
mid-stream."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest
from serve_support import API_KEY, make_pair, start_server, stop_server
from support import env_for_tests, hetero_run_argv, mpirun_argv

pytestmark = pytest.mark.mpi

PROMPTS = ["def is_prime(n):\n", "The quick brown", "class Stack:\n", "for i in range(10):\n"]
SPEC = ("--algorithm", "slem", "--fixed-draft-len", "--draft-len", "3")
NEW = 24


def generate_json(target, drafter, prompts, *flags, np=2) -> list[dict]:
    """What `hetero-run generate --json` prints for these prompts."""
    path = target.parent / f"prompts-{abs(hash((tuple(prompts), flags)))}.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    argv = hetero_run_argv() + ["generate", "--target", str(target), "--drafter", str(drafter), *SPEC,
                                "--prompts-file", str(path), "--dtype", "fp32", "--json", *flags]
    proc = subprocess.run((mpirun_argv(np) if np else []) + argv, capture_output=True, text=True, timeout=300,
                          env=env_for_tests())
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("serve-pair"))


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    target, drafter = pair
    s = start_server(target, drafter, tmp_path_factory.mktemp("serve-log"), *SPEC, "--max-body-bytes", "65536",
                     "--context", "512", env={"HETERO_RUN_API_KEY": API_KEY})
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def reference(pair):
    """generate --json at TP=2: plain prompts and --chat, greedy, NEW tokens, end-of-sequence honoured."""
    target, drafter = pair
    plain = generate_json(target, drafter, PROMPTS, "--max-new-tokens", str(NEW))
    chat = generate_json(target, drafter, PROMPTS[:2], "--max-new-tokens", str(NEW), "--chat")
    return {"plain": dict(zip(PROMPTS, plain, strict=True)), "chat": dict(zip(PROMPTS[:2], chat, strict=True))}


def test_chat_and_completions_equal_generate_json_token_for_token(server, reference):
    client = server.client()
    for prompt in PROMPTS[:2]:
        ref = reference["chat"][prompt]
        out = client.chat.completions.create(model="target", messages=[{"role": "user", "content": prompt}],
                                             max_tokens=NEW, temperature=0, extra_body={"return_token_ids": True})
        choice = out.choices[0]
        assert choice.token_ids == ref["token_ids"] and choice.message.content == ref["text"]
        assert choice.finish_reason == ref["finish_reason"]
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref["prompt_tokens"], ref["new_tokens"])
    for prompt in PROMPTS:
        ref = reference["plain"][prompt]
        out = client.completions.create(model="target", prompt=prompt, max_tokens=NEW, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert out.choices[0].token_ids == ref["token_ids"] and out.choices[0].text == ref["text"]
        assert out.usage.completion_tokens == ref["new_tokens"] and out.usage.total_tokens == \
            ref["prompt_tokens"] + ref["new_tokens"]
        spec = out.model_extra["speculation"]
        assert spec["algorithm"] == "slem" and spec["accepted_tokens"] <= spec["draft_tokens"]
        assert spec["drafts"] >= 1 and spec["tokens_per_round"] >= 1.0
    assert sum(reference["plain"][p]["acceptance_rate"] for p in PROMPTS) > 0  # drafts were accepted somewhere


def test_log_probabilities_come_with_the_speculative_servers_tokens(server, reference):
    """At TP=2 with slem drafting: one entry per shown token, in order, whose bytes spell the
    answer; greedy, so each token is its row's likeliest; streamed as answered whole."""
    client = server.client()
    prompt = PROMPTS[0]
    ref = reference["chat"][prompt]
    out = client.chat.completions.create(model="target", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=NEW, temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content == ref["text"]
    assert b"".join(bytes(c.bytes) for c in content).decode() == ref["text"]
    shown = ref["token_ids"][:-1] if ref["finish_reason"] == "stop" else ref["token_ids"]
    assert len(content) == len(shown)
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token and c.logprob <= 0
        assert c.top_logprobs[0].logprob == c.logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
    _, chunks = stream_chat(client, prompt, max_tokens=NEW, temperature=0, logprobs=True, top_logprobs=3)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]
    text = client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=NEW, temperature=0, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert "".join(logprobs.tokens) == text.choices[0].text == reference["plain"][PROMPTS[1]]["text"]
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:j])) for j in range(len(logprobs.tokens))]
    assert all(len(top) in (2, 3) and top[t] == lp for top, t, lp in
               zip(logprobs.top_logprobs, logprobs.tokens, logprobs.token_logprobs, strict=True))
    # echo: the prompt's tokens first (read on rank 0 from the TP=2 rows of its prefill), the first without figures
    echoed = client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=NEW, temperature=0, logprobs=2,
                                       echo=True)
    both = echoed.choices[0].logprobs
    assert echoed.choices[0].text == PROMPTS[1] + text.choices[0].text == "".join(both.tokens)
    n = len(both.tokens) - len(logprobs.tokens)
    assert both.tokens[n:] == logprobs.tokens and both.token_logprobs[n:] == logprobs.token_logprobs
    assert both.token_logprobs[0] is None and both.top_logprobs[0] is None
    assert all(lp <= 0 and top[t] == lp for top, t, lp in zip(both.top_logprobs[1:n], both.tokens[1:n],
                                                               both.token_logprobs[1:n], strict=True))
    assert both.text_offset == [len("".join(both.tokens[:j])) for j in range(len(both.tokens))]
    scored = client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=0, logprobs=2, echo=True)
    assert scored.choices[0].text == PROMPTS[1] and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.tokens == both.tokens[:n]
    assert scored.choices[0].logprobs.token_logprobs == both.token_logprobs[:n]


def stream_chat(client, prompt, **kw) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model="target", messages=[{"role": "user", "content": prompt}],
                                                 stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_streamed_chat_and_completion_equal_generate(server, reference):
    client = server.client()
    ref = reference["chat"][PROMPTS[0]]
    text, chunks = stream_chat(client, PROMPTS[0], max_tokens=NEW, temperature=0,
                               stream_options={"include_usage": True})
    assert text == ref["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + [ref["finish_reason"]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref["new_tokens"]
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    ref = reference["plain"][PROMPTS[1]]
    stream = client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=NEW, temperature=0, stream=True)
    pieces = [c.choices[0].text for c in stream]
    assert "".join(pieces) == ref["text"] and len(pieces) > 2


def test_raw_sse_framing_and_whole_characters(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers={"authorization": f"Bearer {API_KEY}"},
                      json={"prompt": "café naïve 10€", "max_tokens": 40, "temperature": 0, "stream": True,
                            "ignore_eos": True}, timeout=60) as response:
        raw = b"".join(response.iter_raw())
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    for frame in frames[:-2]:
        assert frame.startswith(b"data: ")
        json.loads(frame[6:].decode("utf-8"))  # each frame is whole UTF-8 and whole JSON


def test_stop_strings_cut_exactly(server, reference):
    client = server.client()
    ref = reference["plain"][PROMPTS[2]]["text"]
    stop = ref[len(ref) // 2:len(ref) // 2 + 3]
    expected = ref[:ref.index(stop)]
    out = client.completions.create(model="target", prompt=PROMPTS[2], max_tokens=NEW, temperature=0, stop=[stop])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < reference["plain"][PROMPTS[2]]["new_tokens"] or expected == ref
    streamed = client.completions.create(model="target", prompt=PROMPTS[2], max_tokens=NEW, temperature=0,
                                         stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_a_seeded_sampled_request_is_reproducible(server, reference):
    client = server.client()

    def sample(seed):
        return client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=NEW, temperature=2.0, seed=seed,
                                         extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids

    first = sample(7)
    assert sample(7) == first and len(first) == NEW
    others = [sample(seed) for seed in (8, 9)]
    greedy = reference["plain"][PROMPTS[1]]["token_ids"]
    assert any(ids != greedy for ids in [first, *others]) and any(ids != first for ids in others)  # it sampled


def test_n_choices_are_each_what_one_request_returns(server, reference):
    """n = 3 at TP=2 with slem: greedy choices are all generate's answer; a seeded request's choice
    i is what the same request with seed + i returns alone."""
    client = server.client()
    prompt = PROMPTS[0]
    out = client.chat.completions.create(model="target", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=NEW, temperature=0, n=3)
    assert [c.message.content for c in out.choices] == [reference["chat"][prompt]["text"]] * 3
    assert out.usage.completion_tokens == 3 * reference["chat"][prompt]["new_tokens"]

    def sample(seed, n=1):
        return client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=NEW, temperature=2.0, seed=seed,
                                         n=n, extra_body={"ignore_eos": True, "return_token_ids": True}).choices

    together = [c.token_ids for c in sample(11, n=3)]
    assert together == [sample(11 + i)[0].token_ids for i in range(3)]
    assert len(set(map(tuple, together))) == 3  # three different samples


def test_seeded_sampled_requests_among_others_return_what_they_return_alone(server, pair):
    """Keyed verification: a seeded request's tokens depend on its seed and the target only, not
    on the requests batched with it, nor on how much was drafted; they equal generate's."""
    client = server.client(timeout=180)

    def sample(i):
        return client.completions.create(model="target", prompt=PROMPTS[i % 4], max_tokens=NEW, temperature=1.0,
                                         seed=100 + i, extra_body={"ignore_eos": True, "return_token_ids": True}
                                         ).choices[0].token_ids

    alone = [sample(i) for i in range(6)]
    together: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(i):
        try:
            together[i] = sample(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [together[i] for i in range(6)] == alone
    target, drafter = pair
    (cli,) = generate_json(target, drafter, [PROMPTS[0]], "--max-new-tokens", str(NEW), "--temperature", "1.0",
                           "--seed", "100", "--ignore-eos")
    assert cli["token_ids"] == alone[0]


def test_eight_concurrent_streams_complete_equal_to_one_by_one(server):
    client = server.client(timeout=180)
    prompts = [f"{PROMPTS[i % 4]}{'#' * (i // 4)}" for i in range(8)]
    one_by_one = [stream_chat(client, p, max_tokens=16, temperature=0)[0] for p in prompts]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i):
        try:
            results[i] = stream_chat(client, prompts[i], max_tokens=16, temperature=0)[0]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [results[i] for i in range(8)] == one_by_one


def test_every_bad_input_gets_its_status_and_the_server_keeps_serving(server):
    client = server.client()
    with pytest.raises(openai.AuthenticationError) as info:
        server.client(api_key="wrong").models.list()
    assert info.value.status_code == 401
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="target", messages=[{"role": "wizard", "content": "x"}])
    assert info.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="target", prompt="x", max_tokens=5000)
    assert info.value.body["n_ctx"] == 512 and "context holds 512 tokens" in info.value.body["message"]
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="target", prompt="x" * 70000, max_tokens=4)
    assert info.value.status_code == 413
    bad_json = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ', timeout=30,
                          headers={"authorization": f"Bearer {API_KEY}"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    assert client.models.list().data[0].id == "target"
    assert client.completions.create(model="target", prompt="The", max_tokens=4).usage.completion_tokens >= 1
    assert API_KEY not in server.log(0)


def test_a_client_that_disconnects_stops_its_generation_and_frees_the_cache(server):
    before = server.metrics()
    aborted = before.get('hetero_run:request_success_total{finished_reason="abort"}', 0.0)
    with httpx.stream("POST", server.url + "/v1/completions", headers={"authorization": f"Bearer {API_KEY}"},
                      json={"prompt": "The", "max_tokens": 480, "temperature": 0, "stream": True, "ignore_eos": True},
                      timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    # the connection is closed here, mid-stream
    end = time.monotonic() + 20
    while time.monotonic() < end:
        now = server.metrics()
        if now.get('hetero_run:request_success_total{finished_reason="abort"}', 0.0) == aborted + 1:
            break
        time.sleep(0.1)
    assert now['hetero_run:request_success_total{finished_reason="abort"}'] == aborted + 1
    assert now["hetero_run:num_requests_running"] == 0 and now["hetero_run:kv_cache_usage_perc"] == 0
    generated = now["hetero_run:generation_tokens_total"] - before["hetero_run:generation_tokens_total"]
    assert 1 <= generated < 480
    assert server.client().completions.create(model="target", prompt="The", max_tokens=3).choices[0].text


def test_health_version_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    version = httpx.get(server.url + "/version").json()
    assert version["state"] == "ready" and version["algorithm"] == "slem"
    m = server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count", "spec_decode_num_drafts_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
        assert "hetero_run:" + name in m, name
    assert m["hetero_run:spec_decode_num_draft_tokens_total"] >= m["hetero_run:spec_decode_num_accepted_tokens_total"]


# -- lifecycle: each of these runs a server of its own ----------------------------------------


def long_stream(server, max_tokens, sink: list, started: threading.Event):
    """Stream a long completion on a thread; `sink` gets the chunks, or the exception."""
    def run():
        try:
            for chunk in server.client(timeout=120).completions.create(
                    model="target", prompt="The", max_tokens=max_tokens, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}):
                sink.append(chunk)
                started.set()
        except BaseException as exc:
            sink.append(exc)
            started.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_sigterm_drains_running_requests_then_every_rank_exits_0(pair, tmp_path):
    target, drafter = pair
    server = start_server(target, drafter, tmp_path, *SPEC, "--context", "2048", "--drain-timeout", "60",
                          env={"HETERO_RUN_API_KEY": API_KEY})
    try:
        chunks, started = [], threading.Event()
        thread = long_stream(server, 1500, chunks, started)
        assert started.wait(60)
        os.kill(server.rank_pid(0), signal.SIGTERM)
        end = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=5).status_code == 200 and time.monotonic() < end:
            time.sleep(0.05)
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
        with pytest.raises(openai.APIStatusError) as info:
            server.client().completions.create(model="target", prompt="x", max_tokens=2)
        assert info.value.status_code == 503
        thread.join(120)
        code, out, err = server.wait(120)
    finally:
        stop_server(server)
    assert not any(isinstance(c, BaseException) for c in chunks), chunks[-1]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].text) > 0 for c in chunks) > 100  # the running request finished in full
    assert code == 0, err
    assert "draining: 1 running" in server.log(0) and "stopped" in server.log(0)
    assert "Traceback" not in err


def test_killing_rank_1_mid_stream_ends_the_stream_with_an_error_and_every_rank(pair, tmp_path):
    target, drafter = pair
    server = start_server(target, drafter, tmp_path, *SPEC, "--context", "4096", "--peer-timeout", "10",
                          env={"HETERO_RUN_API_KEY": API_KEY})
    try:
        chunks, started = [], threading.Event()
        thread = long_stream(server, 3000, chunks, started)
        assert started.wait(60)
        victim = server.rank_pid(1)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        thread.join(30)
        assert isinstance(chunks[-1], openai.APIError), chunks[-1]
        assert "rank 1" in str(chunks[-1])
        try:
            health = httpx.get(server.url + "/health", timeout=5).status_code
        except httpx.TransportError:
            health = None  # already gone
        code, out, err = server.wait(60)
        elapsed = time.monotonic() - killed
    finally:
        stop_server(server)
    assert health in (503, None)
    assert code != 0 and elapsed < 10
    assert f"rank 1 (host {os.uname().nodename}, pid {victim})" in err + server.log(0)
    assert "Traceback" not in err


def test_a_silent_peer_fails_the_stream_once_its_heartbeat_is_late(pair, tmp_path):
    """Rank 1 frozen (as when the link drops): rank 0's engine is stuck in a collective, and the
    heartbeat ends the requests and the job after --peer-timeout."""
    target, drafter = pair
    server = start_server(target, drafter, tmp_path, *SPEC, "--context", "4096", "--peer-timeout", "5",
                          env={"HETERO_RUN_API_KEY": API_KEY})
    victim = server.rank_pid(1)
    try:
        chunks, started = [], threading.Event()
        thread = long_stream(server, 3000, chunks, started)
        assert started.wait(60)
        os.kill(victim, signal.SIGSTOP)
        frozen = time.monotonic()
        thread.join(30)
        assert isinstance(chunks[-1], openai.APIError), chunks[-1]
        assert "rank 1" in str(chunks[-1]) and "sent no heartbeat for 5 s" in str(chunks[-1])
        code, out, err = server.wait(30)
        elapsed = time.monotonic() - frozen
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        stop_server(server)
    assert code != 0 and elapsed < 5 + 10
    assert f"rank 1 (host {os.uname().nodename}, pid {victim}) sent no heartbeat for 5 s" in err + server.log(0)


def test_one_process_serves_and_ctrl_c_stops_it_with_exit_0(pair, tmp_path, reference):
    target, drafter = pair
    server = start_server(target, drafter, tmp_path, *SPEC, np=None)
    try:
        out = server.client(api_key="unused").completions.create(
            model="target", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, extra_body={"return_token_ids": True})
        assert out.choices[0].token_ids == reference["plain"][PROMPTS[0]]["token_ids"]  # TP=1 equals TP=2
        server.proc.send_signal(signal.SIGINT)
        code, _, err = server.wait(60)
    finally:
        stop_server(server)
    assert code == 0, err
    assert "stopped" in server.log(0)
