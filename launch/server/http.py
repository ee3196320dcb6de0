"""uvicorn on a thread of its own, over a socket bound before anything loads.

The socket is bound in the caller's thread, so a taken port is a one-line error before the model
loads. uvicorn runs its event loop on the `http` thread and installs no signal handlers there:
the main thread owns the lifecycle (signals, drain, peer loss) and stops the server with `stop`.
"""

from __future__ import annotations

import socket
import threading

from hetero_run.topology.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", field="--port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class HttpServer:
    def __init__(self, sock: socket.socket, graceful_s: float = 5.0):
        self.sock = sock
        self.graceful_s = graceful_s
        self.server = None
        self.thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self, app) -> None:
        import uvicorn

        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", ws="none",
                                timeout_graceful_shutdown=self.graceful_s, timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http",
                                       daemon=True)
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop accepting, let open responses end (up to the graceful timeout), then close."""
        if self.server is None:
            self.sock.close()
            return
        self.server.should_exit = True
        self.thread.join(self.graceful_s + 2.0 if timeout is None else timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(2.0)
        self.sock.close()
