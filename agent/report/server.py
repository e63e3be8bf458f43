"""HTTP endpoints: /metrics (Prometheus text, or OpenMetrics when the scraper asks), /healthz and /readyz."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder


def parse_address(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    try:
        return (host.strip("[]") or "0.0.0.0", int(port))
    except ValueError:
        raise ValueError(f"expected host:port, got {addr!r}") from None


class HealthServer:
    def __init__(
        self,
        address: str,
        registry: CollectorRegistry,
        healthy: Callable[[], tuple[bool, str]],
        ready: Callable[[], tuple[bool, str]],
    ) -> None:
        host, port = parse_address(address)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    encoder, ctype = choose_encoder(self.headers.get("Accept") or "")
                    body = encoder(registry)
                    self._send(200, body, ctype)
                elif path in ("/healthz", "/livez"):
                    ok, why = healthy()
                    self._send(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
                elif path == "/readyz":
                    ok, why = ready()
                    self._send(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        _ = outer

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
