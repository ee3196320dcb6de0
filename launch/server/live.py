"""The live status line on rank 0's terminal: requests running and waiting, tok/s, acceptance."""

from __future__ import annotations

import threading


class LiveLine:
    def __init__(self, engine, metrics, name: str, interval_s: float = 0.5):
        self.engine, self.metrics, self.name, self.interval_s = engine, metrics, name, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.live = None

    def start(self) -> None:
        from hetero_run.launch.log import console

        err = console(stderr=True)
        if not err.is_terminal:
            return
        from rich.live import Live

        self.live = Live(self.render(), console=err, refresh_per_second=4, transient=True, redirect_stdout=False,
                         redirect_stderr=False)
        self.live.__enter__()
        self._thread = threading.Thread(target=self._run, name="live", daemon=True)
        self._thread.start()

    def render(self) -> str:
        stats, m = self.engine.stats(), self.metrics
        acceptance = f"{m.accepted / m.drafted:6.1%}" if m.drafted else "     -"
        return (f"[bold]{m.recent_tokens_per_second():6.2f} tok/s[/]  running {stats.running}  waiting "
                f"{stats.waiting}  acceptance {acceptance}  [dim]{self.name}, {self.engine.state.value}, "
                f"{m.finished} done, {m.failed} failed, KV {stats.kv_usage:4.0%}[/]")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.live.update(self.render())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if self.live is not None:
            self.live.__exit__(None, None, None)
            self.live = None
