"""A live server for tests: uvicorn serving ``create_app(settings)`` in a background thread on
127.0.0.1 at a free port (loopback only). Shared by the server, web-page, agent and driver tests."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from dflash2_gguf.server.app import ServerSettings, create_app


class LiveServer:
    """uvicorn serving ``create_app(settings)`` in a daemon thread on 127.0.0.1:<free port>."""

    def __init__(self, settings: ServerSettings, load=None, wait_ready: bool = True) -> None:
        self.app = create_app(settings, load=load)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.wait_ready = wait_ready

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.server.started:
                if not self.wait_ready:
                    return self
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("server did not become ready in 120 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()
