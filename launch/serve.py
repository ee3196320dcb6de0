"""Serve the model over an OpenAI-compatible HTTP API on rank 0; the other ranks serve forwards.

    hetero-run serve --target DIR [--drafter DIR|FILE.gguf] [--port 8000] [--api-key KEY]
    mpirun -np 2 --hostfile HOSTS ... hetero-run serve --target DIR --drafter SMALL.gguf --config trtllm.yaml

Rank 0 opens the port first (/health answers 503 while the model loads), loads exactly as
`hetero-run generate` does (launch/generate.py `load`), then serves requests in arrival order,
many at once (runtime/engine: a paged KV cache with prefix caching, continuous batching,
speculation sized for each step). Lifecycle: loading -> ready -> draining -> stopped.
SIGTERM or Ctrl-C on rank 0 stops accepting (503), lets running and queued requests finish for
up to --drain-timeout seconds, aborts the rest, then stops the workers: every rank exits 0. A
lost peer fails the requests in flight with an error, turns /health to 503 and ends every rank
within --peer-timeout, naming the rank (exit status 3).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from hetero_run.launch import generate
from hetero_run.topology.errors import ConfigError, PeerFailure, UserError

NAME = "serve"
HELP = "serve the model over an OpenAI-compatible HTTP API (chat, completions, streaming, metrics)"
API_KEY_ENV = "HETERO_RUN_API_KEY"
PEER_LOST_LINGER_S = 1.0  # after a peer is lost, /health answers 503 this long before the process ends
FLUSH_S = 2.0  # ... and open responses get this long to deliver their error events


def add_arguments(parser: argparse.ArgumentParser) -> None:
    generate.add_model_arguments(parser)
    group = parser.add_argument_group("server (rank 0)")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    group.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    group.add_argument("--api-key", metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' on /v1 routes (or set {API_KEY_ENV})")
    group.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default: the target's "
                       "directory or file name)")
    group.add_argument("--config", metavar="FILE.yaml", help="a trtllm-serve style YAML (speculative_config: "
                       "decoding_type, max_draft_len, speculative_model) or any of these flags by name; flags given "
                       "on the command line win")
    group.add_argument("--max-queue", type=int, default=64, metavar="N",
                       help="requests that may wait while --max-num-seqs others run; more get 429 (default 64)")
    group.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                       help="largest request body; larger gets 413 (default 1 MiB)")
    group.add_argument("--allowed-origins", metavar="ORIGINS",
                       help="comma-separated origins allowed by CORS (default: CORS off); '*' for any")
    group.add_argument("--log-requests", action="store_true", help="log prompts and outputs (off by default)")
    group.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                       help="on SIGTERM / Ctrl-C, how long running requests may finish (default 30)")
    batching = parser.add_argument_group("batching (docs/serve.md)")
    batching.add_argument("--max-num-seqs", type=int, default=8, metavar="N",
                          help="requests decoded together in one step (default 8)")
    batching.add_argument("--max-num-batched-tokens", type=int, default=512, metavar="N",
                          help="rows in one step: decode and draft rows, then prompt chunks (default 512)")
    batching.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV cache block "
                          "(default 16)")
    batching.add_argument("--kv-cache-tokens", type=int, metavar="N",
                          help="KV cache slots on each rank, shared by all requests (default: the plan's, "
                          "--max-num-seqs sequences of --context tokens within the room left; `hetero-run plan` "
                          "prints it)")
    batching.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                          help="reuse the KV cache of prompt prefixes earlier requests computed (default on)")


# -- the config file ----------------------------------------------------------------------------

TRTLLM_KEYS = {"max_seq_len": "context", "max_batch_size": "max_num_seqs", "max_num_tokens": "max_num_batched_tokens"}
DECODING_TYPES = {"drafttarget": "draft_target", "draft_target": "draft_target", "eagle3": "eagle3",
                  "eagle": "eagle3", "ngram": "ngram"}


def apply_config_file(args: argparse.Namespace) -> None:
    """Values from --config for every flag left at its default."""
    if not getattr(args, "config", None):
        return
    import yaml

    path = Path(args.config)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read: {exc}", file=path, field="--config") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", file=path) from None
    if data is None:
        return
    if not isinstance(data, dict):
        raise ConfigError("expected a mapping of keys to values", file=path)
    probe = argparse.ArgumentParser(add_help=False)
    add_arguments(probe)
    actions = {a.dest: a for a in probe._actions if a.dest not in ("help", "config")}
    values: dict[str, object] = {}
    for key, value in data.items():
        if key == "speculative_config":
            values.update(_speculative_config(value, path))
        elif key == "kv_cache_config":
            values.update(_kv_cache_config(value, path))
        elif key in TRTLLM_KEYS:
            values[TRTLLM_KEYS[key]] = value
        elif str(key).replace("-", "_") in actions:
            values[str(key).replace("-", "_")] = value
        else:
            known = sorted([*actions, *TRTLLM_KEYS, "speculative_config", "kv_cache_config"])
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"unknown key{hint}; known keys: speculative_config, kv_cache_config, max_seq_len, "
                              "max_batch_size, max_num_tokens, or any serve flag by "
                              "name (e.g. port, max_queue, drafter)", file=path, field=str(key))
    for dest, value in values.items():
        action = actions[dest]
        if getattr(args, dest) == action.default:
            setattr(args, dest, _coerce(action, value, path, dest))


def _speculative_config(value, path: Path) -> dict:
    if not isinstance(value, dict):
        raise ConfigError("expected a mapping (decoding_type, max_draft_len, speculative_model)", file=path,
                          field="speculative_config")
    out: dict[str, object] = {}
    for key, item in value.items():
        field = f"speculative_config.{key}"
        if key == "decoding_type":
            kind = DECODING_TYPES.get(str(item).lower())
            from hetero_run.runtime.speculative.config import ALGORITHMS

            if kind is None or (kind == "ngram" and "ngram" not in ALGORITHMS):
                raise ConfigError(f"{item!r} is not supported: use DraftTarget (any drafter, any vocabulary) or Eagle3",
                                  file=path, field=field)
            out["_decoding"] = kind
            if kind == "ngram":
                out["algorithm"] = "ngram"
        elif key == "max_draft_len":
            if not isinstance(item, int) or isinstance(item, bool) or item < 1:
                raise ConfigError(f"must be an integer >= 1, got {item!r}", file=path, field=field)
            out["max_draft_len"], out["draft_len"] = item, min(item, 4)
        elif key in ("speculative_model", "speculative_model_dir"):
            out["_model"] = str(item)
        else:
            raise ConfigError("unknown key (expected decoding_type, max_draft_len, speculative_model)", file=path,
                              field=field)
    kind, model = out.pop("_decoding", "draft_target"), out.pop("_model", None)
    if kind in ("draft_target", "eagle3"):
        if model is None:
            raise ConfigError(f"{kind} needs speculative_model", file=path, field="speculative_config")
        out["drafter"] = ("eagle3:" if kind == "eagle3" else "") + model
        if kind == "eagle3":
            out["algorithm"] = "eagle3"
    return out


def _kv_cache_config(value, path: Path) -> dict:
    if not isinstance(value, dict):
        raise ConfigError("expected a mapping (enable_block_reuse)", file=path, field="kv_cache_config")
    out: dict[str, object] = {}
    for key, item in value.items():
        if key != "enable_block_reuse":
            raise ConfigError("unknown key (expected enable_block_reuse)", file=path, field=f"kv_cache_config.{key}")
        out["enable_prefix_caching"] = item
    return out


def _coerce(action: argparse.Action, value, path: Path, dest: str):
    field = dest
    if action.nargs == 0:  # a store_true flag
        if not isinstance(value, bool):
            raise ConfigError(f"expected true or false, got {value!r}", file=path, field=field)
        return value
    if isinstance(value, (dict, list)):
        raise ConfigError(f"expected a single value, got {value!r}", file=path, field=field)
    try:
        value = action.type(str(value)) if action.type is not None else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"not a valid value: {value!r}", file=path, field=field) from None
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"expected one of {', '.join(map(str, action.choices))}, got {value!r}", file=path,
                          field=field)
    return value


# -- the run ------------------------------------------------------------------------------------


class EngineFailed(UserError):
    exit_code = 1


def build_configs(args: argparse.Namespace):
    from hetero_run.kernels.sampling import SamplingParams
    from hetero_run.launch.server.app import ServerSettings

    apply_config_file(args)
    if args.compare:
        raise ConfigError("is for generate; serve answers requests", field="--compare")
    for name in ("max_queue", "max_body_bytes"):
        if getattr(args, name) < (0 if name == "max_queue" else 1):
            raise ConfigError(f"must be >= {0 if name == 'max_queue' else 1}, got {getattr(args, name)}",
                              field="--" + name.replace("_", "-"))
    if not 0 <= args.port < 65536:
        raise ConfigError(f"not a TCP port: {args.port}", field="--port")
    if not args.drain_timeout >= 0:
        raise ConfigError(f"must be >= 0, got {args.drain_timeout}", field="--drain-timeout")
    from hetero_run.runtime.engine.engine import EngineConfig

    try:
        engine = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              enable_prefix_caching=args.enable_prefix_caching)
    except ConfigError as exc:
        raise ConfigError(exc.message, field="--" + (exc.field or "").replace("_", "-")) from None
    config = generate.GenerateConfig(
        target=Path(args.target), sampling=SamplingParams(), json=True, dtype=args.dtype, context=args.context,
        prefill_chunk=args.prefill_chunk, speculation=generate.speculate.speculation_config(args),
        drafter=args.drafter, embedding_split=args.embedding_split, kv_tokens=args.kv_cache_tokens,
        block_size=args.block_size)
    name = args.served_model_name or (config.target.stem if config.target.suffix == ".gguf" else config.target.name)
    origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
    server = ServerSettings(model=name, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                            max_body_bytes=args.max_body_bytes, allowed_origins=origins,
                            log_requests=args.log_requests, version=_version())
    return config, server, engine


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from hetero_run.launch.bootstrap import launched
    from hetero_run.launch.settings import launch_settings

    config, server, engine = build_configs(args)
    plan = generate.check_plan(config, args, batching_config(config, engine))
    config = kv_budget(config, plan)
    settings = launch_settings(args)
    # a drain may take --drain-timeout, then the workers stop and the group comes down
    settings = replace(settings, signal_grace_s=args.drain_timeout + settings.peer_timeout_s + 15.0)
    with launched(settings) as dist:
        from hetero_run.launch.server.http import bind

        sock = generate.together(dist, "open the HTTP port", lambda: bind(args.host, args.port)
                                 if dist.is_driver else None)
        if not dist.is_driver:
            loaded = generate.load(config, args, dist, plan)
            return _worker(loaded, dist)
        return Rank0(args, config, server, engine, dist, sock).run(plan)


def batching_config(config, engine):
    """The scheduler's memory side the plan sizes the KV cache and the activations for."""
    from hetero_run.launch.plan import errors_name_flags
    from hetero_run.runtime.config import BatchingConfig

    with errors_name_flags():
        return BatchingConfig(engine.max_num_seqs, engine.max_num_batched_tokens, config.block_size,
                              config.kv_tokens)


def kv_budget(config, plan):
    """The KV cache the plan sized (runtime/planner kv.py `kv_cache_blocks`: --kv-cache-tokens, or
    --max-num-seqs sequences of --context tokens within the room the tightest rank has), so every
    rank loads exactly the blocks the plan counted."""
    from dataclasses import replace

    if not plan.max_num_seqs_fit:
        from hetero_run.launch.log import get_logger

        get_logger(__name__).warning(
            "the KV cache holds %d sequences of %d tokens at once (--max-num-seqs %d): more wait, or are preempted, "
            "when all run at full length", plan.sequences, plan.context, plan.batching.max_num_seqs)
    return replace(config, kv_tokens=plan.kv_tokens, block_size=plan.batching.block_size)


def _worker(loaded, dist) -> int:
    from hetero_run.launch.log import get_logger
    from hetero_run.runtime.runner import serve_worker

    log = get_logger(__name__)

    def ignore(signum, _frame):
        log.warning("received %s: rank 0 drains, then stops this rank", signal.Signals(signum).name)

    with _handlers(ignore):
        serve_worker(loaded.model, loaded.ctx)
    return 0


class Rank0:
    """The HTTP server, the engine and the lifecycle around them."""

    def __init__(self, args, config, server, engine_config, dist, sock):
        from hetero_run.launch.log import get_logger
        from hetero_run.launch.server.app import create_app
        from hetero_run.launch.server.http import HttpServer
        from hetero_run.launch.server.metrics import Metrics
        from hetero_run.runtime.engine.service import BatchEngine

        self.log = get_logger(__name__)
        self.args, self.config, self.server, self.dist = args, config, server, dist
        self.engine_config = engine_config
        self.peer_failure: PeerFailure | None = None
        self.engine = BatchEngine(args.max_queue, describe_failure=self._describe)
        self.metrics = Metrics(self.engine)
        self.app = create_app(self.engine, server, self.metrics)
        self.http = HttpServer(sock)

    def run(self, plan) -> int:
        from hetero_run.kernels import cpu_ext
        from hetero_run.launch.server.live import LiveLine
        from hetero_run.launch.server.prompts import Prompter
        from hetero_run.runtime.engine.api import EngineState
        from hetero_run.runtime.engine.engine import LLMEngine
        from hetero_run.runtime.runner import TargetRunner

        self.http.start(self.app)
        self.log.info("listening on %s (pid %d); /health answers 503 until the model is loaded", self.http.url,
                      os.getpid())
        try:
            loaded = generate.load(self.config, self.args, self.dist, plan)
        except BaseException:
            self.http.stop(timeout=2.0)
            raise
        with TargetRunner(loaded.model, loaded.ctx) as runner:
            prompter = Prompter(loaded.tokenizer, loaded.stop_ids)
            self.app.state.prompter = prompter
            self.engine.start(LLMEngine(runner, loaded.tokenizer, self.engine_config, loaded.drafter,
                                        self.config.speculation))
            cpu_ext.release_thread_pool()  # the engine's thread computes from now on: one pool of workers
            if self.dist.heartbeat is not None:
                self.dist.heartbeat.on_peer_lost = self._peer_lost
            kv = loaded.model.kv
            self.log.info("serving '%s' at %s/v1: TP=%d, algorithm %s, context %d tokens, up to %d requests at once "
                          "over %d KV blocks of %d tokens%s, queue %d%s", self.server.model, self.http.url,
                          self.dist.world_size, self.engine.algorithm, self.engine.max_context,
                          self.engine_config.max_num_seqs, kv.num_blocks, kv.block_size,
                          ", prefix caching" if self.engine_config.enable_prefix_caching else "", self.args.max_queue,
                          ", API key required" if self.server.api_key else "")
            live = LiveLine(self.engine, self.metrics, self.server.model)
            live.start()
            stop, now = threading.Event(), threading.Event()
            try:
                with _handlers(self._on_signal(stop, now)):
                    while not stop.is_set() and self.engine.state is not EngineState.FAILED:
                        stop.wait(0.25)
                    if self.engine.state is not EngineState.FAILED:
                        self._drain(now)
            finally:
                live.stop()
            if self.engine.state is EngineState.FAILED:
                runner.closed = True  # the group may be broken: no STOP the workers would never read
                self._wind_down()
                if self.peer_failure is not None:
                    raise self.peer_failure
                raise EngineFailed(self.engine.error or "the engine failed")
        self.log.info("stopped")
        return 0

    def _drain(self, now: threading.Event) -> None:
        timeout = self.args.drain_timeout
        stats = self.engine.stats()
        self.log.info("draining: %d running, %d waiting; new requests get 503; up to %g s (signal again to stop now)",
                      stats.running, stats.waiting, timeout)
        done = threading.Event()
        result = {}
        worker = threading.Thread(target=lambda: (result.setdefault("ok", self.engine.drain(timeout)), done.set()),
                                  name="drain", daemon=True)
        worker.start()
        while not done.wait(0.25):
            if now.is_set():
                self.engine.drain(0.0)
        if not result.get("ok", False):
            self.log.warning("drain ended with requests left: they were aborted")
        self.http.stop()
        self.engine.shutdown()

    def _on_signal(self, stop: threading.Event, now: threading.Event):
        def handler(signum, _frame):
            name = signal.Signals(signum).name
            if stop.is_set():
                self.log.warning("received %s again: stopping now", name)
                now.set()
            else:
                stop.set()
        return handler

    def _describe(self, exc: BaseException) -> str:
        import torch.distributed as tdist

        from hetero_run.launch.bootstrap import _looks_like_transport_error
        from hetero_run.launch.watchdog import short_reason

        if self.dist.world_size > 1 and (isinstance(exc, tdist.DistBackendError) or _looks_like_transport_error(exc)):
            self.peer_failure = self.dist.failure(exc)
            return str(self.peer_failure)
        self.log.error("engine step failed", exc_info=exc)  # not a lost peer: a bug, with its traceback
        return f"the engine failed: {type(exc).__name__}: {short_reason(exc)}"

    def _peer_lost(self, message: str) -> None:
        """On the heartbeat's thread, just before it ends the process."""
        self.engine.fail(message)
        self._wind_down(stop_http=False)

    def _wind_down(self, stop_http: bool = True) -> None:
        end = time.monotonic() + FLUSH_S
        while self.app.state.open_requests and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(PEER_LOST_LINGER_S)
        if stop_http:
            self.http.stop(timeout=2.0)


@contextlib.contextmanager
def _handlers(handler) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hetero-run")
    except PackageNotFoundError:
        return "unknown"
