"""Running the app: in the foreground (`hf-bdlm serve`) or in a background thread (tests, evaluation, callbacks).

Stopping (SIGTERM, as Kubernetes and systemd send it, or Ctrl-C): uvicorn closes the listening socket, so new
connections are refused (a load balancer or client retries elsewhere, as with any uvicorn server); the requests in
flight run to their end. Those still running after `SHED_AT` of `ServerConfig.shutdown_grace_s` are answered 503 with
`Retry-After` (a stream: an error chunk, then `[DONE]`), their jobs leave the batch at the next block, and uvicorn's
own limit (the whole grace period) cancels whatever is left; then the batch worker stops and the process exits 0.

    from hf_bdlm.serving import Engine, ServerConfig, ServerThread
    with ServerThread(Engine.from_pretrained("path/to/bdlm"), ServerConfig(port=0)) as server:
        print(server.base_url)      # http://127.0.0.1:<free port>/v1
"""

from __future__ import annotations

import asyncio
import gc
import signal
import socket
import threading
import time

import uvicorn

from .app import create_app
from .config import ServerConfig
from .engine import Engine


SHED_AT = 0.8  # of the grace period: what still runs then is answered 503, before uvicorn would cut it


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown answers the requests still running at ``SHED_AT`` of the grace period
    with a 503 (``BatchScheduler.shed``) instead of letting the limit cut them without an answer."""

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown
        scheduler = getattr(getattr(self.config.app, "state", None), "scheduler", None)
        shedding = None
        if grace is not None and scheduler is not None:
            shedding = asyncio.get_running_loop().call_later(SHED_AT * grace, scheduler.shed,
                                                             "the server is shutting down")
        try:
            await super().shutdown(sockets)
        finally:
            if shedding is not None:
                shedding.cancel()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve(engine: Engine, config: ServerConfig) -> None:
    """Serve in the foreground until SIGTERM or Ctrl-C, then drain (see the module docstring) and return."""
    server = DrainingServer(uvicorn.Config(create_app(engine, config), host=config.host, port=config.port,
                                           log_level="info", timeout_graceful_shutdown=config.shutdown_grace_s))
    # Once drained, uvicorn raises the stop signal again under the handler it found: the drain answered it, so that
    # handler does nothing and the process ends normally (exit 0), not killed by its own signal.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, _answered)
    server.run()
    # The interpreter's teardown would collect every object of torch and transformers once more: 2.4-2.6 s on the
    # 2-core CI machine, 0.4 s with the survivors frozen out of the collector (the pod is gone sooner).
    gc.collect()
    gc.freeze()


def _answered(signum, frame) -> None:
    """The stop signal, raised again after the graceful shutdown that answered it."""


class ServerThread:
    """The server on a background thread, as a context manager. `port=0` picks a free port.

    Attributes:
        base_url (`str`): `http://host:port/v1`, what OpenAI clients take as `base_url`.
        app: the FastAPI app (its `state.scheduler.stats` counts batches).
    """

    def __init__(self, engine: Engine, config: ServerConfig | None = None, startup_timeout: float = 60.0):
        config = config or ServerConfig()
        if config.port == 0:
            config.port = free_port(config.host)
        self.config = config
        self.app = create_app(engine, config)
        self._server = DrainingServer(uvicorn.Config(self.app, host=config.host, port=config.port,
                                                     log_level="warning", lifespan="on",
                                                     timeout_graceful_shutdown=config.shutdown_grace_s))
        self._thread = threading.Thread(target=self._server.run, name="hf-bdlm-server", daemon=True)
        self.startup_timeout = startup_timeout

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}/v1"

    def start(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.config.host}:{self.config.port}.")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Drain as `hf-bdlm serve` does on SIGTERM: refuse new connections, let the requests in flight finish."""
        self._server.should_exit = True
        self._thread.join(timeout=self.config.shutdown_grace_s + 30)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
