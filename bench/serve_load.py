"""Load `hetero-run serve` with N concurrent streaming clients, per concurrency level, bounded in
time and requests; against a running server, or launching the servers itself.

    python bench/serve_load.py --url http://127.0.0.1:8000 --concurrency 1,4,8 --duration 60
    python bench/serve_load.py --launch TARGET --drafter DRAFTER [--tp 2] --duration 60 \\
        --max-tokens 64 --json-out serve_load.json --png serve_load.png

`--launch` starts one server per configuration (TP=1 as one process, `--tp 2` under
`mpirun -np 2`), each on a free loopback port, waits for /health 200, loads it, reads every
rank's peak memory, then sends SIGTERM to rank 0 and waits until every process has exited
(whatever happened). Configurations: `off` (the target alone, `--algorithm none`) and
`adaptive` (`--drafter D --algorithm auto`), fed the same prompts in the same order.
The servers are up together and take turns level by level (the order alternating from one
level to the next), so the two figures of a level are measured about a minute apart, not a
whole run apart: this host's speed drifts by 10-25% within minutes. `--rounds N` splits each
level into N rounds of --duration / N seconds with the turns taken round by round, so drift
within a level falls on both configurations alike; a level's figures are over all its rounds
(and each round's aggregate is listed). An idle server takes under 1% of a core.
`--one-at-a-time` runs each configuration's levels in turn with only its server up (a target
that fits in memory once).

Per level each client sends chat requests one after another (bench/prompts/speculative.jsonl,
round robin) until --duration has passed or --max-requests were sent; a request started
before the end runs to completion (at most --request-timeout). Figures: completed / failed /
lost (a lost request got neither a complete answer nor a clear error: exit status 1),
aggregate tok/s (completion tokens of completed requests / wall time), in-window tok/s (the
tokens that arrived within the --duration window, each request's first at its TTFT and the rest
spread evenly to its end, / --duration: free of the tail in which the last requests finish with
fewer clients running, which moves the aggregate by a few per cent from run to run), per-request tok/s p50
((tokens - 1) / (end - first token), vLLM's 1 / TPOT), TTFT p50 / p99 (request sent to first
text), end-to-end p50, and the server's /metrics speculation counters over the level
(acceptance: accepted / draft tokens; acceptance length: 1 + accepted / drafts).

Then the second-turn test (--turns N conversations, one at a time): turn 1 asks about a long
document; turn 2 repeats turn 1's prompt and answer and asks again, so the prefix cache holds
all but the new question: TTFT of turn 2 / turn 1 and `usage.prompt_tokens_details.cached_tokens`.
With --launch, peak memory: VmHWM of every rank's process against the per-rank total of
`hetero-run plan --json` for the same target, drafter, context, batch (--max-num-seqs) and TP
(minus what the plan reserves for the operating system).

The summary names the ratios the serving aims use: aggregate at 8 clients over 1, adaptive
over off at each level, turn-2 TTFT over turn-1, peak memory over the plan.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_servers import OFF, Launched, planned_bytes, server_argv

PROMPTS = Path(__file__).parent / "prompts" / "speculative.jsonl"
SPEC_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "generation_tokens_total", "prompt_tokens_total")


def load_prompts(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            out.append(item.get("prompt") or item.get("text"))
    return [p for p in out if p]


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None


# -- one request ----------------------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, url: str, messages: list[dict], args, max_tokens: int) -> dict:
    """One streamed chat request -> outcome ("completed", "error", "lost"), timings, usage, text."""
    body = {"model": args.model, "messages": messages, "max_tokens": max_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = {"outcome": "lost", "start": start, "ttft": None, "seconds": None, "tokens": 0, "prompt_tokens": 0,
              "cached": 0, "text": ""}
    pieces = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                error = json.loads(await response.aread()).get("error", {})
                result.update(outcome="error", error=f"{response.status_code} {error.get('message')}")
                return result
            finished = usage = done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.update(outcome="error", error=chunk["error"].get("message"))
                    return result
                if chunk.get("usage"):
                    usage = True
                    result["tokens"] = chunk["usage"]["completion_tokens"]
                    result["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                    result["cached"] = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        pieces.append(text)
                        if result["ttft"] is None:
                            result["ttft"] = time.perf_counter() - start
                    finished = finished or choice.get("finish_reason") is not None
            if finished and usage and done:
                result.update(outcome="completed", seconds=time.perf_counter() - start, text="".join(pieces))
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.update(outcome="error" if isinstance(exc, httpx.HTTPStatusError) else "lost", error=repr(exc))
    return result


def _client(args, connections: int) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.AsyncClient(headers=headers, limits=httpx.Limits(max_connections=connections + 2),
                             timeout=httpx.Timeout(args.request_timeout))


# -- a concurrency level ----------------------------------------------------------------------------


def in_window(r: dict, start: float, end: float) -> float:
    """The tokens of a completed request that arrived within [start, end]: its first token at its
    TTFT, the others spread evenly until it ended (streamed steps are short beside a request)."""
    first, last, n = r["start"] + r["ttft"], r["start"] + r["seconds"], r["tokens"]
    if n < 1 or r["ttft"] is None:
        return 0.0
    count = 1.0 if start <= first <= end else 0.0
    if n > 1 and last > first:
        count += (n - 1) * max(0.0, min(last, end) - max(first, start)) / (last - first)
    return count


async def run_part(args, url: str, concurrency: int, prompts: list[str], duration: float, max_requests: int,
                   first: int = 0) -> dict:
    """`concurrency` clients send requests for `duration` seconds (at most `max_requests`); prompts
    round robin from the `first`-th on -> the raw results and the window."""
    results: list[dict] = []
    end = time.perf_counter() + duration
    async with _client(args, concurrency) as client:
        async def worker():
            while time.perf_counter() < end and len(results) < max_requests:
                i = len(results)
                results.append({})  # takes its place in max_requests before it is sent
                messages = [{"role": "user", "content": prompts[(first + i) % len(prompts)]}]
                results[i] = await one_request(client, url, messages, args, args.max_tokens)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"results": results, "start": start, "end": end, "wall": wall}


def summarise(concurrency: int, parts: list[dict]) -> dict:
    """One level's figures over its parts (one per round): counts and tokens summed, rates over the
    parts' summed wall time and windows, percentiles over every request."""
    results = [r for p in parts for r in p["results"]]
    done = [r for r in results if r["outcome"] == "completed"]
    window = sum(in_window(r, p["start"], p["end"]) for p in parts for r in p["results"] if r["outcome"] == "completed")
    span = sum(p["end"] - p["start"] for p in parts)
    wall = sum(p["wall"] for p in parts)
    per_request = [(r["tokens"] - 1) / (r["seconds"] - r["ttft"]) for r in done
                   if r["tokens"] > 1 and r["ttft"] is not None and r["seconds"] > r["ttft"]]
    tokens = sum(r["tokens"] for r in done)
    return {"concurrency": concurrency, "rounds": len(parts), "sent": len(results), "completed": len(done),
            "failed": sum(r["outcome"] == "error" for r in results),
            "lost": sum(r["outcome"] == "lost" for r in results),
            "ttft_p50_s": pct([r["ttft"] for r in done if r["ttft"] is not None], 0.5),
            "ttft_p99_s": pct([r["ttft"] for r in done if r["ttft"] is not None], 0.99),
            "e2e_p50_s": pct([r["seconds"] for r in done], 0.5),
            "per_request_tok_s_p50": pct(per_request, 0.5),
            "output_tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_second": round(tokens / wall, 2) if wall > 0 else 0.0,
            "window_tokens_per_second": round(window / span, 2) if span > 0 else 0.0,
            "rounds_tokens_per_second": [round(sum(r["tokens"] for r in p["results"] if r["outcome"] == "completed")
                                               / p["wall"], 2) if p["wall"] > 0 else 0.0 for p in parts],
            "mean_tokens_per_request": round(statistics.mean(r["tokens"] for r in done), 1) if done else 0,
            "errors": sorted({r.get("error", "") for r in results if r["outcome"] != "completed"})[:5]}


def scrape(url: str) -> dict[str, float]:
    """The /metrics counters this bench reads (0 where absent)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.removeprefix("hetero_run:")] = float(value)
    return {name: values.get(name, 0.0) for name in SPEC_COUNTERS}


def speculation(d: dict) -> dict:
    """The speculation figures of counter increments `d` (SPEC_COUNTERS)."""
    drafts, drafted, accepted = (d["spec_decode_num_drafts_total"], d["spec_decode_num_draft_tokens_total"],
                                 d["spec_decode_num_accepted_tokens_total"])
    return {"drafts": int(drafts), "draft_tokens": int(drafted), "accepted_tokens": int(accepted),
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None}


# -- the second chat turn ---------------------------------------------------------------------------


def document(conversation: int, tokens: int) -> str:
    """A deterministic Python module of about `tokens` tokens; the first line differs per conversation."""
    lines = [f"# module {conversation}: helpers for a small inventory service"]
    i = 0
    while sum(len(x) for x in lines) < tokens * 3:
        lines += [f"def price_{i}(quantity, unit={i + 1}.5):", f'    """Total for {i} items at the unit price."""',
                  f"    return round(quantity * unit * {1 + i % 7}, 2)", ""]
        i += 1
    return "\n".join(lines)


async def second_turn(args, url: str) -> dict:
    """--turns conversations, one at a time: TTFT of turn 2 (turn 1 and its answer repeated) / turn 1."""
    pairs = []
    async with _client(args, 1) as client:
        for n in range(args.turns):
            first = [{"role": "user", "content": document(n, args.turn_prompt_tokens) +
                      "\n\nWhat does this module do? Answer briefly."}]
            one = await one_request(client, url, first, args, args.max_tokens)
            if one["outcome"] != "completed" or one["ttft"] is None:
                pairs.append({"error": one.get("error", "turn 1 gave no text")})
                continue
            second = first + [{"role": "assistant", "content": one["text"]},
                              {"role": "user", "content": "Name its first function only."}]
            two = await one_request(client, url, second, args, 8)
            if two["outcome"] != "completed" or two["ttft"] is None:
                pairs.append({"error": two.get("error", "turn 2 gave no text")})
                continue
            pairs.append({"turn1_ttft_s": round(one["ttft"], 4), "turn2_ttft_s": round(two["ttft"], 4),
                          "turn1_prompt_tokens": one["prompt_tokens"], "turn1_output_tokens": one["tokens"],
                          "turn2_prompt_tokens": two["prompt_tokens"], "turn1_cached_tokens": one["cached"],
                          "turn2_cached_tokens": two["cached"]})
    good = [p for p in pairs if "error" not in p]
    t1 = round(statistics.median(p["turn1_ttft_s"] for p in good), 4) if good else None
    t2 = round(statistics.median(p["turn2_ttft_s"] for p in good), 4) if good else None
    return {"conversations": pairs, "turn1_ttft_p50_s": t1, "turn2_ttft_p50_s": t2,
            "turn2_prompt_tokens_p50": statistics.median(p["turn2_prompt_tokens"] for p in good) if good else None,
            "ratio": round(t2 / t1, 4) if good and t1 else None,
            "turn2_cached_tokens_p50": statistics.median(p["turn2_cached_tokens"] for p in good) if good else None}


def run_launched(args, prompts: list[str]) -> dict:
    if args.one_at_a_time:
        out = {}
        for name in args.configs:
            out.update(_with_servers(args, [name], prompts))
        return out
    return _with_servers(args, args.configs, prompts)


def _with_servers(args, names: list[str], prompts: list[str]) -> dict:
    """Start the servers of `names`, measure every level on each (taking turns), then stop them."""
    out, servers, plans = {}, {}, {}
    try:
        for name in names:
            argv = server_argv(args, name)
            print(f"\n== {name}: {' '.join(argv)}", flush=True)
            plans[name] = planned_bytes(args, name)
            server = Launched(name, argv, args.log_dir / name, args.tp)
            out[name] = {"argv": argv, "tp": args.tp, "log_dir": str(server.log_dir)}
            servers[name] = server
            try:
                server.start(args.startup_timeout)
            except RuntimeError as exc:
                out[name]["error"] = str(exc)
                print(f"  {exc}", flush=True)
                continue
            print(f"  ready at {server.url} after {server.load_s} s (rank pids {server.pids})", flush=True)
            out[name]["load_s"] = server.load_s
        ready = [n for n in names if "error" not in out[n]]
        for name in ready:
            prepare(args, servers[name].url, prompts)
        for name in ready:
            out[name]["levels"] = []
        for i, level in enumerate(args.levels):
            parts: dict[str, list] = {name: [] for name in ready}
            for r in range(args.rounds):  # the order alternating from one round (and level) to the next
                for name in (ready if (i + r) % 2 == 0 else ready[::-1]):
                    sent = sum(len(p["results"]) for p in parts[name])
                    parts[name].append(measure_part(args, servers[name].url, level, prompts, sent))
            for name in ready:
                out[name]["levels"].append(report_level(args, level, parts[name], name))
        for name in ready:
            out[name]["second_turn"] = measure_turns(args, servers[name].url, name)
            peak, plan = servers[name].peak_memory(), plans[name]
            out[name]["memory"] = [{"rank": rank, "pid": servers[name].pids[rank], "peak_bytes": peak[rank],
                                    "plan_bytes": (plan or {}).get(rank),
                                    "ratio": round(peak[rank] / plan[rank], 3) if plan and peak[rank] else None}
                                   for rank in peak]
            for m in out[name]["memory"]:
                print(f"  {name}: rank {m['rank']}: peak memory {_gib(m['peak_bytes'])}, planned "
                      f"{_gib(m['plan_bytes'])}", flush=True)
    except RuntimeError as exc:  # a server that stopped answering
        for name in names:
            out[name].setdefault("error", str(exc))
        print(f"  {exc}", flush=True)
    finally:
        for name, server in servers.items():
            server.stop(args.drain_timeout + 60)
            out[name]["exit_code"] = server.exit_code
            print(f"  {name}: stopped (exit status {server.exit_code})", flush=True)
    return out


def _gib(n) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


# -- one server's measurements ------------------------------------------------------------------------


def prepare(args, url: str, prompts: list[str]) -> None:
    """The served model's name, then the unmeasured warm-up requests."""
    if args.model is None:
        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        args.model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    for i in range(args.warmup):  # first calls compile and fault in the weights
        asyncio.run(_warm(args, url, prompts[i % len(prompts)]))


def measure_part(args, url: str, level: int, prompts: list[str], first: int = 0) -> dict:
    """One round of a level on one server (--duration / --rounds seconds), with the server's
    speculation counters over it."""
    before = scrape(url)
    part = asyncio.run(run_part(args, url, level, prompts, args.duration / args.rounds,
                                -(-args.max_requests // args.rounds), first))
    after = scrape(url)
    part["counters"] = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    return part


def report_level(args, level: int, parts: list[dict], name: str = "") -> dict:
    """A level's figures over its rounds, printed (JSON with --json)."""
    report = summarise(level, parts)
    report["speculation"] = speculation({k: sum(p["counters"][k] for p in parts) for k in SPEC_COUNTERS})
    if args.json:
        print(json.dumps(report), flush=True)
        return report
    print(f"  {name + ': ' if name else ''}{level_line(report)}", flush=True)
    for error in report["errors"]:
        print(f"      {error}", flush=True)
    return report


def measure_level(args, url: str, level: int, prompts: list[str], name: str = "") -> dict:
    """Every round of one level on one server."""
    parts: list[dict] = []
    for _ in range(args.rounds):
        parts.append(measure_part(args, url, level, prompts, sum(len(p["results"]) for p in parts)))
    return report_level(args, level, parts, name)


def measure_turns(args, url: str, name: str = "") -> dict | None:
    turns = asyncio.run(second_turn(args, url)) if args.turns else None
    if turns and args.json:
        print(json.dumps({"second_turn": turns}), flush=True)
    elif turns:
        print(f"  {name + ': ' if name else ''}second turn: TTFT p50 {turns['turn1_ttft_p50_s']} s -> "
              f"{turns['turn2_ttft_p50_s']} s (x{turns['ratio']}); turn 2: {turns['turn2_cached_tokens_p50']} of its "
              f"{turns['turn2_prompt_tokens_p50']} prompt tokens cached", flush=True)
    return turns


def measure(args, url: str, prompts: list[str]) -> dict:
    """Every level, then the second turns, on one running server."""
    prepare(args, url, prompts)
    levels = [measure_level(args, url, level, prompts) for level in args.levels]
    return {"levels": levels, "second_turn": measure_turns(args, url)}


async def _warm(args, url: str, prompt: str) -> None:
    async with _client(args, 1) as client:
        await one_request(client, url, [{"role": "user", "content": prompt}], args, min(8, args.max_tokens))


def level_line(r: dict) -> str:
    spec = r.get("speculation") or {}
    accept = f"; acceptance {spec['acceptance']:.2f}" if spec.get("acceptance") is not None else ""
    rounds = f"; rounds {', '.join(map(str, r['rounds_tokens_per_second']))} tok/s" if r.get("rounds", 1) > 1 else ""
    return (f"concurrency {r['concurrency']}: {r['completed']}/{r['sent']} completed, {r['failed']} failed, "
            f"{r['lost']} lost; {r['tokens_per_second']} tok/s aggregate ({r['output_tokens']} tokens in "
            f"{r['wall_s']} s), {r['window_tokens_per_second']} tok/s in the window, "
            f"{r['per_request_tok_s_p50']} tok/s per request p50; TTFT p50 {r['ttft_p50_s']} s, "
            f"p99 {r['ttft_p99_s']} s; e2e p50 {r['e2e_p50_s']} s{accept}{rounds}")


# -- the summary --------------------------------------------------------------------------------------


def aims(configs: dict) -> list[dict]:
    """The serving aims, each with its figure and whether it was met."""
    out = []

    def aggregate(name, level, key="tokens_per_second"):
        row = next((r for r in configs.get(name, {}).get("levels", []) if r["concurrency"] == level), None)
        return row.get(key) if row else None

    def add(what, value, bound, met):
        out.append({"aim": what, "value": value, "bound": bound, "met": None if value is None else met(value)})

    for name in configs:
        for key, what in (("tokens_per_second", "aggregate"), ("window_tokens_per_second", "in-window")):
            one, eight = aggregate(name, 1, key), aggregate(name, 8, key)
            add(f"{name}: {what} at 8 / at 1", round(eight / one, 3) if one and eight is not None else None, ">= 4",
                lambda v: v >= 4)
    if "off" in configs and "adaptive" in configs:
        for row in configs["off"].get("levels", []):
            level = row["concurrency"]
            off, adaptive = aggregate("off", level), aggregate("adaptive", level)
            bound = 1.3 if level == 1 else 1.0
            add(f"adaptive / off aggregate at {level}", round(adaptive / off, 3) if off and adaptive is not None
                else None, f">= {bound}", lambda v, b=bound: v >= b)
            off, adaptive = (aggregate(n, level, "window_tokens_per_second") for n in ("off", "adaptive"))
            add(f"adaptive / off in-window at {level}", round(adaptive / off, 3) if off and adaptive is not None
                else None, f">= {bound}", lambda v, b=bound: v >= b)
    for name, result in configs.items():
        turns = result.get("second_turn") or {}
        if turns:
            add(f"{name}: turn-2 TTFT / turn-1", turns.get("ratio"), "<= 0.3", lambda v: v <= 0.3)
        for m in result.get("memory", []):
            add(f"{name}: rank {m['rank']} peak memory / plan", m["ratio"], "<= 1", lambda v: v <= 1.0)
    return out


def print_summary(configs: dict, goals: list[dict]) -> None:
    print("\n| config | clients | completed / sent | failed, lost | aggregate tok/s | in-window tok/s | "
          "per request tok/s p50 | TTFT p50 / p99 s | e2e p50 s | acceptance |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, result in configs.items():
        for r in result.get("levels", []):
            spec = r.get("speculation") or {}
            accept = "-" if spec.get("acceptance") is None else \
                f"{spec['acceptance']:.2f} ({spec['accepted_tokens']}/{spec['draft_tokens']})"
            print(f"| {name} | {r['concurrency']} | {r['completed']} / {r['sent']} | {r['failed']}, {r['lost']} | "
                  f"{r['tokens_per_second']} | {r.get('window_tokens_per_second')} | {r['per_request_tok_s_p50']} | "
                  f"{r['ttft_p50_s']} / {r['ttft_p99_s']} | "
                  f"{r['e2e_p50_s']} | {accept} |")
    if goals:
        print("\n| aim | figure | bound | met |\n|---|---|---|---|")
        for g in goals:
            met = "n/a" if g["met"] is None else "yes" if g["met"] else "NO"
            print(f"| {g['aim']} | {g['value']} | {g['bound']} | {met} |")


def chart(configs: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = set()
    for name, result in configs.items():
        rows = [r for r in result.get("levels", []) if r["completed"]]
        x = [r["concurrency"] for r in rows]
        levels.update(x)
        left.plot(x, [r["tokens_per_second"] for r in rows], marker="o", label=name)
        right.plot(x, [r["ttft_p50_s"] for r in rows], marker="o", label=name)
    for ax, what, unit in ((left, "aggregate output", "tok/s"), (right, "time to first token, p50", "s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels), [str(x) for x in sorted(levels)])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(unit)
        ax.set_title(what)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--url", help="a running server (default http://127.0.0.1:8000 without --launch)")
    target.add_argument("--launch", metavar="TARGET", help="start the servers for the target (DIR or FILE.gguf)")
    parser.add_argument("--drafter", help="with --launch: the drafter of the adaptive configuration")
    parser.add_argument("--configs", default=None, help="with --launch: off (--algorithm none), adaptive (auto with "
                        "--drafter) or an algorithm name (with --drafter); default off,adaptive (without --drafter: "
                        "off)")
    parser.add_argument("--tp", type=int, default=1, help="with --launch: tensor-parallel size (2: mpirun -np 2)")
    parser.add_argument("--context", type=int, default=2048, help="with --launch: --context of the servers")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="with --launch: requests batched together "
                        "(default: the highest concurrency)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="FLAGS",
                        help="with --launch: more serve flags, e.g. --serve-arg='--block-size 32' (repeatable)")
    parser.add_argument("--log-dir", type=Path, default=None, help="with --launch: server logs (default: a new "
                        "temporary folder)")
    parser.add_argument("--one-at-a-time", action="store_true", help="with --launch: one server up at a time, "
                        "each configuration's levels in turn (default: all up, taking turns level by level)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to load")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="the servers' --drain-timeout")
    parser.add_argument("--model", default=None, help="the served model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels (default 1,2,4,8,16)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per level in which requests start")
    parser.add_argument("--max-requests", type=int, default=1000, help="per level, at most")
    parser.add_argument("--rounds", type=int, default=1, help="split each level into this many rounds of "
                        "--duration / N s; with --launch the configurations take turns round by round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests before the first level")
    parser.add_argument("--turns", type=int, default=3, help="second-turn conversations (0: none)")
    parser.add_argument("--turn-prompt-tokens", type=int, default=512, help="about this long a first turn")
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--json", action="store_true", help="print one JSON object per level instead of lines")
    parser.add_argument("--json-out", type=Path, help="write every figure to this JSON file")
    parser.add_argument("--png", type=Path, help="write the chart (aggregate tok/s and TTFT p50 vs clients)")
    args = parser.parse_args(argv)
    args.levels = [int(x) for x in args.concurrency.split(",")]
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.launch:
        names = (args.configs or ("off,adaptive" if args.drafter else "off")).split(",")
        if any(n != OFF for n in names) and not args.drafter:
            parser.error("every configuration but off needs --drafter")
        args.configs = names
        args.max_num_seqs = args.max_num_seqs or max(args.levels)
        args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="serve-load-"))
    elif args.drafter or args.configs:
        parser.error("--drafter and --configs go with --launch")
    args.url = args.url or "http://127.0.0.1:8000"
    return args


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt  # the servers are stopped on the way out


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = load_prompts(args.prompts)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.launch:
            print(f"serve_load: {args.launch} at TP={args.tp}, configurations {', '.join(args.configs)}, clients "
                  f"{args.concurrency}, {args.duration:g} s or {args.max_requests} requests per level, "
                  f"{args.max_tokens} tokens per request; logs in {args.log_dir}", flush=True)
            configs = run_launched(args, prompts)
        else:
            if not args.json:
                print(f"serve_load: {args.url}, clients {args.concurrency}, {args.duration:g} s or "
                      f"{args.max_requests} requests per level, {args.max_tokens} tokens per request", flush=True)
            configs = {"server": measure(args, args.url, prompts)}
    except KeyboardInterrupt:
        print("\ninterrupted: every server this run started has been stopped", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    goals = aims(configs)
    if not args.json:
        print_summary(configs, goals)
    if args.json_out:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json_out.write_text(json.dumps({"settings": settings, "configs": configs, "aims": goals}, indent=1))
        print(f"\nwrote {args.json_out}")
    if args.png:
        where = f"{Path(args.launch).name}, TP={args.tp}" if args.launch else args.url
        chart(configs, args.png, f"hetero-run serve under load: {where}, {args.max_tokens} tokens per request")
        print(f"wrote {args.png}")
    lost = sum(r["lost"] for c in configs.values() for r in c.get("levels", []))
    broken = [n for n, c in configs.items() if c.get("error") or c.get("exit_code") not in (None, 0)]
    if lost or broken:
        print(f"\n{lost} requests lost; configurations that failed or exited badly: {', '.join(broken) or 'none'}")
    return 1 if lost or broken else 0


if __name__ == "__main__":
    sys.exit(main())
