"""Real `hetero-run serve` processes for the server tests: a tiny trained pair (a qwen2 target over
byte-level BPE, a llama drafter over a SentencePiece-style vocabulary), and a helper that starts
a server (under `mpirun -np 2` or as one process), waits until it is ready and stops it.

    from serve_support import make_pair, start_server, stop_server
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from support import env_for_tests, hetero_run_argv, mpirun_argv, rank_pids

API_KEY = "test-key-123"


def make_pair(root: Path) -> tuple[Path, Path]:
    import speculative_support as support

    paths = []
    for name, tokenizer, arch, seed in (("target", support.byte_level(), "qwen2", 0),
                                        ("drafter", support.sentencepiece(), "llama", 1)):
        support.trained_model(tokenizer, arch, seed=seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths.append(root / name)
    return paths[0], paths[1]


@dataclass
class Server:
    proc: subprocess.Popen
    log_dir: Path
    url: str = ""
    np: int | None = 2

    def log(self, rank: int = 0) -> str:
        path = self.log_dir / f"rank{rank}.log"
        return path.read_text() if path.exists() else ""

    def rank_pid(self, rank: int) -> int:
        if self.np is None:
            return self.proc.pid
        (pid,) = rank_pids(self.proc.pid, rank)
        return pid

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", API_KEY), max_retries=0,
                      timeout=kw.pop("timeout", 120), **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def wait(self, timeout: float = 120) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


def start_server(target: Path, drafter: Path | None, log_dir: Path, *flags: str, np: int | None = 2,
                 timeout: float = 240, env: dict | None = None) -> Server:
    argv = hetero_run_argv() + ["serve", "--target", str(target), "--dtype", "fp32", "--port", "0",
                                "--log-dir", str(log_dir), *flags]
    if drafter is not None:
        argv += ["--drafter", str(drafter)]
    if np is not None:
        argv = mpirun_argv(np) + argv
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_for_tests(env), start_new_session=True)
    server = Server(proc, log_dir, np=np)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = re.search(r"serving '[^']+' at (http://[^/\s]+)/v1", server.log())
        if found:
            server.url = found.group(1)
            return server
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the server ended before it was ready ({proc.returncode}):\n{out}\n{err}")
        time.sleep(0.2)
    stop_server(server)
    raise AssertionError(f"the server was not ready within {timeout} s:\n{server.log()}")


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        try:
            os.kill(server.rank_pid(0), signal.SIGTERM)
            server.proc.wait(60)
        except (ValueError, ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
