"""The smallest correct unary gRPC client over HTTP/2 on a unix socket, for kubelet's pod-resources API.

Why not grpcio: it adds ~21 MiB RSS to an agent whose whole budget is ~41 MiB (docs/performance.md). This
speaks the gRPC wire protocol (grpc/grpc:doc/PROTOCOL-HTTP2.md) with the pure-Python `h2` state machine: the
connection preface,
a large initial window (WINDOW_UPDATE as data arrives), one HEADERS frame (`:method POST`, `:scheme http`,
`:path /<service>/<method>`, `:authority localhost`, `content-type application/grpc`, `te trailers`,
`grpc-timeout`), one length-prefixed message with END_STREAM, then everything read until the trailers
(`grpc-status`, `grpc-message`) or a Trailers-Only response. PING is answered by h2; GOAWAY and RST_STREAM end the
call with a clear error. Every read has a hard deadline (the socket timeout is the time left) and the response is
bounded (MAX_RESPONSE bytes by default). A new connection per call: kubelet re-creates its socket on restart.

`h2` is imported when a call is made (only when the pod-resources probe is on), never at module import."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any
from urllib.parse import unquote

MAX_RESPONSE = 16 * 2**20  # bytes of gRPC message data accepted in one response
WINDOW = 16 * 2**20  # the stream's and the connection's receive window (kubelet sends without waiting)
READ_CHUNK = 65536

# gRPC status codes used for failures of the transport itself (grpc/grpc:doc/statuscodes.md)
DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE = 4, 8, 13, 14
STATUS_NAMES = {
    0: "OK",
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    11: "OUT_OF_RANGE",
    12: "UNIMPLEMENTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}


class GrpcError(Exception):
    """A call that did not return a message: `code` is the gRPC status (the server's, or UNAVAILABLE for a socket
    that cannot be reached, DEADLINE_EXCEEDED for the deadline, RESOURCE_EXHAUSTED for the size bound, INTERNAL for
    a protocol error); str() is one line for people."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def status(self) -> str:
        return STATUS_NAMES.get(self.code, str(self.code))


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n} bytes"


def _timeout_header(seconds: float) -> str:
    """grpc-timeout: at most 8 digits and a unit; milliseconds here."""
    return f"{max(1, min(int(seconds * 1000), 99_999_999))}m"


def unary_call(
    socket_path: str,
    method: str,
    request: bytes,
    timeout: float,
    max_response: int = MAX_RESPONSE,
) -> bytes:
    """One unary call of `method` (`/package.Service/Method`) with the serialized `request`; returns the response
    message's bytes. Raises GrpcError (never OSError or an h2 exception)."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as e:
        raise GrpcError(UNAVAILABLE, f"cannot make a unix socket: {e}") from None
    try:
        sock.settimeout(max(0.001, timeout))
        try:
            sock.connect(socket_path)
        except TimeoutError:
            raise GrpcError(DEADLINE_EXCEEDED, f"{socket_path}: connect timed out after {timeout:g}s") from None
        except OSError as e:
            raise GrpcError(UNAVAILABLE, f"{socket_path}: cannot connect: {e.strerror or e}") from None
        return _call(sock, socket_path, method, request, deadline, timeout, max_response)
    finally:
        sock.close()


def _call(
    sock: socket.socket, path: str, method: str, request: bytes, deadline: float, timeout: float, max_response: int
) -> bytes:
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions
    import h2.settings

    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW}
    )
    conn.initiate_connection()
    conn.increment_flow_control_window(WINDOW - 65535)  # the connection window starts at 64 KiB
    stream = conn.get_next_available_stream_id()
    conn.send_headers(
        stream,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", method),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("grpc-timeout", _timeout_header(max(0.0, deadline - time.monotonic()))),
            ("grpc-accept-encoding", "identity"),
            ("user-agent", "gpu-ready"),
        ],
    )
    conn.send_data(stream, b"\x00" + struct.pack(">I", len(request)) + request, end_stream=True)

    headers: dict[str, str] = {}
    trailers: dict[str, str] = {}
    body = bytearray()
    ended = False
    try:
        _send(sock, conn.data_to_send(), path, deadline, timeout)
        while not ended:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GrpcError(DEADLINE_EXCEEDED, f"{path} {method}: no complete answer within {timeout:g}s")
            sock.settimeout(left)
            try:
                data = sock.recv(READ_CHUNK)
            except TimeoutError:
                raise GrpcError(DEADLINE_EXCEEDED, f"{path} {method}: no complete answer within {timeout:g}s") from None
            except OSError as e:
                raise GrpcError(UNAVAILABLE, f"{path} {method}: read failed: {e.strerror or e}") from None
            if not data:
                raise GrpcError(UNAVAILABLE, f"{path} {method}: the server closed the connection before the trailers")
            events = conn.receive_data(data)
            for ev in events:
                if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == stream:
                    headers = _headers(ev.headers)
                elif isinstance(ev, h2.events.TrailersReceived) and ev.stream_id == stream:
                    trailers = _headers(ev.headers)
                elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == stream:
                    if len(body) + len(ev.data) > max_response + 5:
                        raise GrpcError(
                            RESOURCE_EXHAUSTED,
                            f"{path} {method}: the response exceeds the {_size(max_response)} bound",
                        )
                    body += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, stream)
                elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == stream:
                    ended = True
                elif isinstance(ev, h2.events.StreamReset) and ev.stream_id == stream:
                    raise GrpcError(
                        UNAVAILABLE if ev.error_code == 7 else INTERNAL,  # 7: REFUSED_STREAM
                        f"{path} {method}: the server reset the stream (HTTP/2 error {int(ev.error_code)})",
                    )
                elif isinstance(ev, h2.events.ConnectionTerminated) and not ended:
                    last = ev.last_stream_id
                    if last is not None and last >= stream and ev.error_code == 0:
                        continue  # a graceful GOAWAY that still covers our stream: keep reading
                    raise GrpcError(
                        UNAVAILABLE,
                        f"{path} {method}: the server sent GOAWAY (HTTP/2 error {int(ev.error_code or 0)})",
                    )
            out = conn.data_to_send()  # PING acks, WINDOW_UPDATEs, SETTINGS acks
            if out:
                _send(sock, out, path, deadline, timeout)
    except h2.exceptions.ProtocolError as e:
        raise GrpcError(INTERNAL, f"{path} {method}: HTTP/2 protocol error: {e}") from None
    return _message(headers, trailers or headers, bytes(body), path, method, max_response)


def _send(sock: socket.socket, data: bytes, path: str, deadline: float, timeout: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise GrpcError(DEADLINE_EXCEEDED, f"{path}: no complete answer within {timeout:g}s")
    sock.settimeout(left)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise GrpcError(DEADLINE_EXCEEDED, f"{path}: write timed out after {timeout:g}s") from None
    except OSError as e:
        raise GrpcError(UNAVAILABLE, f"{path}: write failed: {e.strerror or e}") from None


def _headers(raw: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in raw:
        key = k.decode("latin-1") if isinstance(k, bytes) else str(k)
        out[key.lower()] = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
    return out


def _message(
    headers: dict[str, str], trailers: dict[str, str], body: bytes, path: str, method: str, max_response: int
) -> bytes:
    where = f"{path} {method}"
    status = headers.get(":status")
    if status != "200":
        raise GrpcError(UNAVAILABLE if status in ("502", "503", "504") else INTERNAL, f"{where}: HTTP status {status}")
    ctype = headers.get("content-type", "")
    if not ctype.startswith("application/grpc"):
        raise GrpcError(INTERNAL, f"{where}: content-type {ctype!r} is not gRPC")
    code_text = trailers.get("grpc-status")
    if code_text is None or not code_text.isdigit():
        raise GrpcError(INTERNAL, f"{where}: the response has no grpc-status")
    code = int(code_text)
    if code != 0:
        text = unquote(trailers.get("grpc-message", ""))[:500]
        name = STATUS_NAMES.get(code, str(code))
        raise GrpcError(code, f"{where}: {name}" + (f": {text}" if text else ""))
    if len(body) < 5:
        raise GrpcError(INTERNAL, f"{where}: OK without a response message")
    compressed, length = body[0], struct.unpack(">I", body[1:5])[0]
    if compressed:
        raise GrpcError(INTERNAL, f"{where}: the response is compressed (identity was asked)")
    if length > max_response:
        raise GrpcError(RESOURCE_EXHAUSTED, f"{where}: the response exceeds the {_size(max_response)} bound")
    if len(body) != 5 + length:
        raise GrpcError(INTERNAL, f"{where}: message length {length} does not match the {len(body) - 5} bytes sent")
    return body[5:]
