"""The course's server in a background thread: `running_server`, for notebooks and tests.

`python -m minifer.serve` is how minifer serves; a notebook cell (lesson 11) or a test wants the
same server for the length of a ``with`` block, on a free port, stopped at the end of it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from minifer.serve.api import (
    DEFAULT_HOST,
    LOOPBACK_HOSTS,
    MAX_CONNECTIONS,
    SHUTDOWN_GRACE_S,
    create_app,
    make_server,
    server_config,
)

__all__ = ["running_server"]


def _free_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


_APP_OPTIONS = ("model_root", "max_model_len", "max_tokens", "request_timeout_s", "max_waiting",
                "api_key", "allowed_hosts", "scheduling_policy", "read_timeout_s",
                "max_body_bytes", "max_header_bytes", "threads", "engine_in", "replicas",
                "chat_template_timeout_s", "chat_template_max_chars")


@contextlib.contextmanager
def running_server(model=None, tokenizer=None, *, engine: Any = None,
                   model_name: str = "minifer", host: str = DEFAULT_HOST, port: int = 0,
                   max_connections: int = MAX_CONNECTIONS, log_level: str = "warning",
                   startup_timeout_s: float = 30.0,
                   shutdown_grace_s: float = SHUTDOWN_GRACE_S, **options) -> Iterator[str]:
    """Serve in a background thread; yields the base URL (``http://127.0.0.1:PORT``).

    Give a model (and tokenizer) plus `LLMEngine` options, or a ready `engine`. `create_app`'s
    options go to the app, the rest to `LLMEngine`. ``port=0`` picks a free port. The server is
    always stopped when the block ends::

        with running_server(model, tok, model_name="shakespeare", max_num_seqs=8) as url:
            httpx.post(f"{url}/v1/completions", json={"model": "shakespeare", "prompt": "ROMEO:"})
    """
    app_options = {k: options.pop(k) for k in _APP_OPTIONS if k in options}
    if engine is None:
        if model is None:
            raise ValueError("give a model (and tokenizer) or a ready engine=")
        from minifer.engine.llm_engine import LLMEngine

        engine = LLMEngine(model, tokenizer, **options)
    elif options or model is not None:
        raise ValueError("give either engine= or a model with engine options, not both; "
                         f"unknown server options: {sorted(options)}")
    if "allowed_hosts" not in app_options and host not in LOOPBACK_HOSTS:
        app_options["allowed_hosts"] = None  # bound to a network address: its names are many
    app = create_app(engine, model_name=model_name, **app_options)
    sock = _free_socket(host, port)
    server = make_server(server_config(app, max_connections=max_connections,
                                       log_level=log_level, shutdown_grace_s=shutdown_grace_s))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="minifer-http", daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        while not server.started:
            if not thread.is_alive() or time.monotonic() - t0 > startup_timeout_s:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.01)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        yield f"http://{shown}:{bound_port}"
    finally:
        server.should_exit = True  # a graceful shutdown: see `make_server`
        thread.join(timeout=shutdown_grace_s + 15)
        sock.close()
