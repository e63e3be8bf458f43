"""HTTP endpoints: /metrics (Prometheus text, or OpenMetrics when the scraper asks), /healthz and /readyz.

Bounded whatever the clients do: one thread accepts connections and reads request
heads without blocking, so an idle or slow connection costs no thread; a fixed pool of `workers` threads
answers complete requests. At most `max_connections` connections wait for their request head (the oldest
is closed first), a head must arrive within `head_timeout_s` and fit in MAX_HEAD bytes, at most
`queue_size` complete requests wait for a worker (beyond that a request gets 503 at once), and a client
that does not read its answer within WRITE_TIMEOUT_S is dropped. One request per connection (HTTP/1.0).
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

MAX_HEAD = 8192
WRITE_TIMEOUT_S = 5.0
BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nbusy\n"


def parse_address(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    try:
        return (host.strip("[]") or "0.0.0.0", int(port))
    except ValueError:
        raise ValueError(f"expected host:port, got {addr!r}") from None


class _SocketWriter(io.BufferedIOBase):
    """A write-only file over a blocking socket (with a timeout) that sends everything it is given."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self._sock.sendall(b)
        return len(memoryview(b))


class _Pending:
    __slots__ = ("addr", "deadline", "head", "sock")

    def __init__(self, sock: socket.socket, addr: Any, deadline: float) -> None:
        self.sock = sock
        self.addr = addr
        self.head = b""
        self.deadline = deadline


class HealthServer:
    def __init__(
        self,
        address: str,
        registry: CollectorRegistry,
        healthy: Callable[[], tuple[bool, str]],
        ready: Callable[[], tuple[bool, str]],
        *,
        workers: int = 4,
        max_connections: int = 64,
        queue_size: int = 16,
        head_timeout_s: float = 5.0,
    ) -> None:
        host, port = parse_address(address)
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self._sock = socket.create_server((host, port), family=family, backlog=max_connections)
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self.workers = workers
        self.max_connections = max_connections
        self.head_timeout_s = head_timeout_s
        self.rejected = 0  # connections closed unanswered (too many, too slow, queue full)
        self._queue: queue.Queue[tuple[socket.socket, Any, bytes] | None] = queue.Queue(maxsize=queue_size)
        self._pending: dict[socket.socket, _Pending] = {}  # in accept order, so the oldest is first
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self._threads: list[threading.Thread] = [threading.Thread(target=self._accept_loop, name="http", daemon=True)]
        self._threads += [
            threading.Thread(target=self._work, name=f"http-worker-{i}", daemon=True) for i in range(workers)
        ]

        class Handler(BaseHTTPRequestHandler):
            server_version = "gpu-ready"

            def setup(self) -> None:
                self.connection, head = self.request
                self.rfile = io.BytesIO(head)
                self.wfile = _SocketWriter(self.connection)

            def finish(self) -> None:
                with contextlib.suppress(OSError):
                    self.wfile.flush()

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/metrics":
                        encoder, ctype = choose_encoder(self.headers.get("Accept") or "")
                        self._send(200, encoder(registry), ctype)
                    elif path in ("/healthz", "/livez"):
                        ok, why = healthy()
                        self._send(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
                    elif path == "/readyz":
                        ok, why = ready()
                        self._send(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
                    else:
                        self._send(404, b"not found\n", "text/plain; charset=utf-8")
                except OSError:
                    raise
                except Exception as e:  # a callback failed: say so instead of dropping the connection
                    self._send(500, f"internal error: {type(e).__name__}\n".encode(), "text/plain; charset=utf-8")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._handler = Handler

    def start(self) -> HealthServer:
        self._sel.register(self._sock, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        for _ in range(self.workers):
            self._queue.put(None)
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=WRITE_TIMEOUT_S + 1)
        for p in list(self._pending.values()):
            self._drop(p)
        while True:  # requests still queued when the workers stopped
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].close()
        self._sel.close()
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the accepting thread: reads request heads, never blocks on one client -------------------------

    def _accept_loop(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            first = next(iter(self._pending.values()), None)
            timeout = None if first is None else max(first.deadline - now, 0.0)
            for key, _ in self._sel.select(timeout):
                if key.fileobj is self._sock:
                    self._accept()
                elif key.fileobj == self._wake_r:
                    return
                else:
                    self._read(key.data)
            now = time.monotonic()
            while self._pending:  # accept order = deadline order: expire from the front
                p = next(iter(self._pending.values()))
                if p.deadline > now:
                    break
                self._drop(p)

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. EMFILE: the listening socket stays readable and is retried
            sock.setblocking(False)
            p = _Pending(sock, addr, time.monotonic() + self.head_timeout_s)
            self._pending[sock] = p
            self._sel.register(sock, selectors.EVENT_READ, p)
            while len(self._pending) > self.max_connections:
                self._drop(next(iter(self._pending.values())))

    def _read(self, p: _Pending) -> None:
        if p.sock not in self._pending:
            return  # closed earlier in this round (evicted)
        try:
            data = p.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data or len(p.head) + len(data) > MAX_HEAD:
            self._drop(p)
            return
        p.head += data
        if b"\r\n\r\n" not in p.head and b"\n\n" not in p.head:
            return
        self._sel.unregister(p.sock)
        del self._pending[p.sock]
        try:
            self._queue.put_nowait((p.sock, p.addr, p.head))
        except queue.Full:
            self.rejected += 1
            with contextlib.suppress(OSError):
                p.sock.send(BUSY)
            p.sock.close()

    def _drop(self, p: _Pending) -> None:
        self.rejected += 1
        self._pending.pop(p.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(p.sock)
        p.sock.close()

    # -- the workers ------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            sock, addr, head = item
            try:
                sock.setblocking(True)
                sock.settimeout(WRITE_TIMEOUT_S)
                self._handler((sock, head), addr, self)  # type: ignore[arg-type]
            except Exception:  # a client that went away or stalled: nothing to answer
                pass
            finally:
                sock.close()
