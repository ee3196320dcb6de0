"""Load a running `hetero-run serve`: N concurrent streaming clients for a bounded time.

    python bench/serve_load.py --url http://127.0.0.1:8000 --concurrency 4 --duration 60
    python bench/serve_load.py --url ... --concurrency 1,4,8 --duration 60 --max-tokens 64 --json

Each client sends chat requests one after another (prompts from bench/prompts/speculative.jsonl,
round robin) until the duration is up; a request started before the end runs to completion. It
prints, per concurrency: completed and failed requests, TTFT p50 / p99 (arrival to the first
text), end-to-end p50, aggregate output tok/s (completion tokens of completed requests / wall
time), and the loss check: every request sent got either a complete answer (finish_reason and
usage, then [DONE]) or a clear error (an HTTP status with an OpenAI error body, or an error
event); a request that got neither is counted as lost and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

PROMPTS = Path(__file__).parent / "prompts" / "speculative.jsonl"


def load_prompts(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            out.append(item.get("prompt") or item.get("text"))
    return [p for p in out if p]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, args) -> dict:
    body = {"model": args.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = {"outcome": "lost", "ttft": None, "seconds": None, "tokens": 0}
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
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content") and result["ttft"] is None:
                        result["ttft"] = time.perf_counter() - start
                    finished = finished or choice.get("finish_reason") is not None
            if finished and usage and done:
                result.update(outcome="completed", seconds=time.perf_counter() - start)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.update(outcome="error" if isinstance(exc, httpx.HTTPStatusError) else "lost", error=repr(exc))
    return result


async def run_level(args, concurrency: int, prompts: list[str]) -> dict:
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 2)
    timeout = httpx.Timeout(args.request_timeout)
    results: list[dict] = []
    end = time.perf_counter() + args.duration
    counter = iter(range(10**9))

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        async def worker():
            while time.perf_counter() < end and len(results) < args.max_requests:
                i = next(counter)
                results.append(await one_request(client, args.url, prompts[i % len(prompts)], args))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    done = [r for r in results if r["outcome"] == "completed"]
    ttft = sorted(r["ttft"] for r in done if r["ttft"] is not None)
    e2e = sorted(r["seconds"] for r in done)

    def pct(xs, q):
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None

    return {"concurrency": concurrency, "sent": len(results), "completed": len(done),
            "failed": sum(r["outcome"] == "error" for r in results),
            "lost": sum(r["outcome"] == "lost" for r in results),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), "e2e_p50_s": pct(e2e, 0.5),
            "output_tokens": sum(r["tokens"] for r in done), "wall_s": round(wall, 2),
            "tokens_per_second": round(sum(r["tokens"] for r in done) / wall, 2) if wall > 0 else 0.0,
            "mean_tokens_per_request": round(statistics.mean(r["tokens"] for r in done), 1) if done else 0,
            "errors": sorted({r.get("error", "") for r in results if r["outcome"] != "completed"})[:5]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="the served model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated levels (default 1,4,8)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per level in which requests start")
    parser.add_argument("--max-requests", type=int, default=1000, help="per level, at most")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--json", action="store_true", help="one JSON object per level")
    args = parser.parse_args()
    if args.model is None:
        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        args.model = httpx.get(args.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    prompts = load_prompts(args.prompts)
    lost = 0
    for level in [int(x) for x in args.concurrency.split(",")]:
        report = asyncio.run(run_level(args, level, prompts))
        lost += report["lost"]
        if args.json:
            print(json.dumps(report), flush=True)
        else:
            print(f"concurrency {level}: {report['completed']}/{report['sent']} completed, {report['failed']} failed, "
                  f"{report['lost']} lost; TTFT p50 {report['ttft_p50_s']} s, p99 {report['ttft_p99_s']} s; e2e p50 "
                  f"{report['e2e_p50_s']} s; {report['tokens_per_second']} tok/s aggregate "
                  f"({report['output_tokens']} tokens in {report['wall_s']} s)", flush=True)
            for error in report["errors"]:
                print(f"    {error}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
