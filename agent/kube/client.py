"""A small JSON client on top of the official `kubernetes` package's ApiClient (auth, TLS, kubeconfig
and in-cluster config come from it). Raw dicts instead of the generated models keep the hot path
cheap; every request is counted for the metrics by an optional callback."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import quote

import urllib3

from agent import __version__
from agent.lazy import import_light

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, Configuration

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"
PARTIAL_METADATA = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1, application/json"
WATCH_READ_CHUNK = 64 * 1024
MAX_WATCH_LINE = 8 * 1024 * 1024  # one watch event (a whole Node as JSON); etcd caps objects at 1.5 MiB


class ApiError(Exception):
    """An API request failed. status 0 = no HTTP answer (connection refused, timeout, TLS)."""

    def __init__(
        self, status: int, message: str, body: dict[str, Any] | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.body = body or {}
        self.retry_after_s = retry_after_s  # the server's Retry-After (429, 503), seconds; None: not given


def retry_after(headers: Any, body: Any) -> float | None:
    """Seconds from a Retry-After header (delta-seconds) or the Status body's details.retryAfterSeconds."""
    raw = headers.get("Retry-After") if headers is not None and hasattr(headers, "get") else None
    if isinstance(raw, str) and raw.strip().isdigit() and len(raw.strip()) <= 6:
        return float(raw.strip())
    details = body.get("details") if isinstance(body, dict) else None
    secs = details.get("retryAfterSeconds") if isinstance(details, dict) else None
    return float(secs) if isinstance(secs, int) and not isinstance(secs, bool) and 0 < secs <= 86_400 else None


class ClientLayer(NamedTuple):
    """The parts of the official client the agent calls: its Configuration (auth, TLS, proxies), its REST
    object (urllib3 pool, TLS and proxy setup) and its ApiException. `light`: loaded without the package
    `__init__`s (agent/lazy.py), i.e. without the generated models, pydantic, yaml, websocket, oauthlib."""

    configuration: type[Configuration]
    rest_client: Callable[[Configuration], Any]
    api_exception: type[Exception]
    light: bool


# the modules of the light path, in import order (rest.py imports the two kubernetes.utils modules: loaded
# first, their package's __init__, which pulls yaml and the dynamic client helpers, stays deferred); a client
# release that moves one makes the agent use the plain import
LIGHT_MODULES = {
    "utils.retry": "kubernetes.utils.retry",
    "utils.keepalive": "kubernetes.utils.keepalive",
    "configuration": "kubernetes.client.configuration",
    "exceptions": "kubernetes.client.exceptions",
    "rest": "kubernetes.client.rest",
}
FULL_CLIENT_ENV = "GPU_READY_FULL_CLIENT"  # "1": always the plain `import kubernetes` (an escape hatch)
_layer: ClientLayer | None = None


def client_layer() -> ClientLayer:
    """The official client's REST layer, imported once: light when possible, else through the plain import."""
    global _layer
    if _layer is None:
        _layer = _load_client_layer()
    return _layer


def _load_client_layer() -> ClientLayer:
    if os.environ.get(FULL_CLIENT_ENV, "") not in ("1", "true"):
        try:
            mods = {k: import_light(name) for k, name in LIGHT_MODULES.items()}
            conf, rest, exc = mods["configuration"], mods["rest"], mods["exceptions"]
            layer = ClientLayer(conf.Configuration, rest.RESTClientObject, exc.ApiException, True)
            # what kubernetes.config.incluster_config takes from the (deferred) package without its __init__
            import_light("kubernetes.client").__dict__.setdefault("Configuration", layer.configuration)
            return layer
        except (ImportError, AttributeError):
            pass  # a layout this agent does not know: the plain import below
    import kubernetes.client as kc

    return ClientLayer(kc.Configuration, lambda cfg: kc.ApiClient(cfg).rest_client, kc.ApiException, False)


def load_incluster(cfg: Configuration) -> None:
    """The in-cluster service account (token file re-read as it rotates) into `cfg`; ConfigException
    (kubernetes.config.config_exception) when not in a cluster."""
    if client_layer().light:
        try:
            incluster = import_light("kubernetes.config.incluster_config")
        except ImportError:
            incluster = None
        if incluster is not None:
            incluster.load_incluster_config(client_configuration=cfg)
            return
    import kubernetes.config

    kubernetes.config.load_incluster_config(client_configuration=cfg)


def config_exception() -> type[Exception]:
    try:
        mod = import_light("kubernetes.config.config_exception")
        exc: type[Exception] = mod.ConfigException
        return exc
    except (ImportError, AttributeError):
        import kubernetes.config

        return kubernetes.config.ConfigException


def load_kubeconfig(cfg: Configuration, path: str | None) -> None:
    """A kubeconfig file into `cfg`: the plain cases (token or client certificate, CA, server) read here with
    yaml; anything else (exec plugins, auth providers, basic auth, impersonation, proxies) by the official
    loader, which costs the whole client."""
    if path and simple_kubeconfig(path, cfg):
        return
    import kubernetes.config

    kubernetes.config.load_kube_config(config_file=path, client_configuration=cfg)


SIMPLE_USER_KEYS = {"token", "tokenFile", "client-certificate", "client-certificate-data", "client-key"}
SIMPLE_USER_KEYS |= {"client-key-data"}
SIMPLE_CLUSTER_KEYS = {"server", "certificate-authority", "certificate-authority-data", "insecure-skip-tls-verify"}
KUBECONFIG_LIMIT = 4 << 20  # bytes


def simple_kubeconfig(path: str, cfg: Configuration) -> bool:
    """True when the kubeconfig's current context is a plain one and `cfg` now holds it; False (cfg untouched)
    for anything this reader does not handle, so the caller uses the official loader."""
    import base64
    import tempfile

    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(KUBECONFIG_LIMIT + 1)
        if len(text) > KUBECONFIG_LIMIT:
            return False
        doc = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        ctx_name = doc["current-context"]
        ctx = _named(doc.get("contexts"), ctx_name)["context"]
        cluster = _named(doc.get("clusters"), ctx["cluster"])["cluster"]
        user = _named(doc.get("users"), ctx["user"])["user"] or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, AttributeError, ValueError):
        return False
    if not isinstance(cluster, dict) or not isinstance(user, dict) or not isinstance(cluster.get("server"), str):
        return False
    if set(cluster) - SIMPLE_CLUSTER_KEYS or set(user) - SIMPLE_USER_KEYS:
        return False
    base = os.path.dirname(os.path.abspath(path))

    def file_of(d: dict[str, Any], key: str) -> str | None:
        if d.get(f"{key}-data"):
            fd, name = tempfile.mkstemp(prefix="gpu-ready-kubeconfig-")
            with os.fdopen(fd, "wb") as out:
                out.write(base64.standard_b64decode(str(d[f"{key}-data"])))
            return name
        if d.get(key):
            return os.path.join(base, str(d[key]))
        return None

    token = user.get("token")
    try:
        if not token and user.get("tokenFile"):
            with open(os.path.join(base, str(user["tokenFile"])), encoding="utf-8") as fh:
                token = fh.read(64 * 1024).strip()
        ca = file_of(cluster, "certificate-authority")
        cert, key = file_of(user, "client-certificate"), file_of(user, "client-key")
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    cfg.host = str(cluster["server"]).rstrip("/")
    if ca:
        cfg.ssl_ca_cert = ca
    if cluster.get("insecure-skip-tls-verify") is True:
        cfg.verify_ssl = False
    if cert and key:
        cfg.cert_file, cfg.key_file = cert, key
    if token:
        cfg.api_key = {"authorization": f"Bearer {token}"}
    return True


def _named(items: Any, name: Any) -> dict[str, Any]:
    for it in items or []:
        if isinstance(it, dict) and it.get("name") == name:
            return it
    raise KeyError(name)


class KubeApi:
    def __init__(
        self,
        configuration: Configuration,
        timeout_s: float = 10.0,
        on_request: Callable[[str, int], None] | None = None,
    ) -> None:
        configuration.retries = False  # retries are ours (kube/backoff.py)
        self.configuration = configuration
        self.layer = client_layer()
        self.rest = self.layer.rest_client(configuration)
        self._api: ApiClient | None = None
        self.user_agent = f"gpu-ready/{__version__}"
        self.timeout_s = timeout_s
        self.on_request = on_request
        self.on_response_bytes: Callable[[str, int], None] | None = None  # (verb, body bytes) of each answer
        # ask for metadata-only answers (PartialObjectMetadata) to node status patches: the agent never reads
        # the answer, and the whole Node it would get back is the biggest part of a heartbeat's cost
        self.metadata_answers = False

    @classmethod
    def from_environment(
        cls,
        kubeconfig: str | None = None,
        timeout_s: float = 10.0,
        on_request: Callable[[str, int], None] | None = None,
    ) -> KubeApi:
        cfg = client_layer().configuration()
        if kubeconfig:
            load_kubeconfig(cfg, kubeconfig)
        else:
            try:
                load_incluster(cfg)
            except config_exception():
                load_kubeconfig(cfg, os.path.expanduser(os.environ.get("KUBECONFIG", "~/.kube/config")))
        return cls(cfg, timeout_s, on_request)

    @classmethod
    def from_token(
        cls,
        host: str,
        token: str,
        ca_file: str | None = None,
        timeout_s: float = 10.0,
        on_request: Callable[[str, int], None] | None = None,
    ) -> KubeApi:
        cfg = client_layer().configuration(host=host)
        cfg.api_key = {"authorization": f"Bearer {token}"}
        if ca_file:
            cfg.ssl_ca_cert = ca_file
        else:
            cfg.verify_ssl = False
        return cls(cfg, timeout_s, on_request)

    @property
    def api(self) -> ApiClient:
        """The official ApiClient on the same configuration (the whole client: only for callers that want
        its serialisation; the agent itself uses `rest`)."""
        if self._api is None:
            import kubernetes.client

            self._api = kubernetes.client.ApiClient(self.configuration)
        return self._api

    def close(self) -> None:
        self.rest.close()
        if self._api is not None:
            self._api.close()

    def _url(self, path: str, query: Iterable[tuple[str, str]] | None) -> str:
        url = self.configuration.host + path
        q = "&".join(f"{k}={quote(str(v))}" for k, v in query or ())
        return f"{url}?{q}" if q else url

    def _headers(self, accept: str, content_type: str | None = None) -> dict[str, str]:
        h = {"Accept": accept, "User-Agent": self.user_agent}
        if content_type:
            h["Content-Type"] = content_type
        auth = self.configuration.auth_settings().get("BearerToken")  # re-reads a rotated token (its hook)
        if auth and auth.get("value"):
            h[str(auth["key"])] = str(auth["value"])
        return h

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
        timeout_s: float | None = None,
        verb: str | None = None,
        accept: str = "application/json",
    ) -> dict[str, Any]:
        """One request, the JSON answer as a dict. `verb` names it for the on_request count (default: the
        HTTP method; "LIST" for a collection read, as the apiserver's own metrics name it)."""
        url = self._url(path, (query or {}).items())
        hdrs = self._headers(accept, content_type)
        status, headers = 0, None
        try:
            resp = self.rest.request(method, url, headers=hdrs, body=body, _request_timeout=timeout_s or self.timeout_s)
            resp.read()
            status = resp.status
            raw = resp.data or b"{}"
        except self.layer.api_exception as e:
            status, body_, headers = getattr(e, "status", 0) or 0, getattr(e, "body", None), getattr(e, "headers", None)
            raw = (body_ or "").encode() if isinstance(body_, str) else (body_ or b"")
        except (urllib3.exceptions.HTTPError, OSError) as e:
            self._count(verb or method, 0)
            raise ApiError(0, f"{method} {path}: {type(e).__name__}: {e}") from e
        self._count(verb or method, status)
        if self.on_response_bytes is not None:
            self.on_response_bytes(verb or method, len(raw))
        try:
            obj = json.loads(raw) if raw else {}
        except ValueError:
            obj = {"message": raw[:200].decode("utf-8", "replace")}
        if status >= 400:
            raise ApiError(status, f"{method} {path}: {obj.get('message', '')}", obj, retry_after(headers, obj))
        return obj

    def _count(self, verb: str, code: int) -> None:
        if self.on_request is not None:
            self.on_request(verb, code)

    # -- the calls the agent makes --------------------------------------------------------------

    def get_node(self, name: str, resource_version: str | None = None) -> dict[str, Any]:
        """Without resource_version: a quorum read from etcd. resource_version="0": served from the
        apiserver's watch cache (may be slightly stale, costs etcd nothing)."""
        query = {"resourceVersion": resource_version} if resource_version is not None else None
        return self.request("GET", f"/api/v1/nodes/{quote(name)}", query=query)

    def list_nodes(self, field_selector: str, resource_version: str = "0", match: str | None = None) -> dict[str, Any]:
        """A NodeList. resource_version "0" (any) or a resourceVersion with match "NotOlderThan" is served
        from the apiserver's watch cache; only resource_version "" would be a quorum read."""
        query = {"fieldSelector": field_selector, "resourceVersion": resource_version}
        if match:
            query["resourceVersionMatch"] = match
        return self.request("GET", "/api/v1/nodes", query=query, verb="LIST")

    def watch_nodes(
        self, field_selector: str, resource_version: str, timeout_seconds: int, bookmarks: bool = True
    ) -> WatchStream:
        """Opens a watch (GET /api/v1/nodes?watch=1) that the server ends after `timeout_seconds`.
        Raises ApiError when it cannot be opened (an HTTP error status, or no answer)."""
        query = [
            ("fieldSelector", field_selector),
            ("watch", "1"),
            ("allowWatchBookmarks", "true" if bookmarks else "false"),
            ("resourceVersion", resource_version),
            ("timeoutSeconds", str(int(timeout_seconds))),
        ]
        return self.stream("/api/v1/nodes", query, read_timeout_s=timeout_seconds + 30.0)

    def stream(self, path: str, query: list[tuple[str, str]], read_timeout_s: float) -> WatchStream:
        """A streaming GET (a watch): the response is not read here; iterate WatchStream.events()."""
        url, hdrs = self._url(path, query), self._headers("application/json")
        try:
            resp = self.rest.request("GET", url, headers=hdrs, _request_timeout=(self.timeout_s, read_timeout_s))
        except self.layer.api_exception as e:
            status = getattr(e, "status", 0) or 0
            self._count("WATCH", status)
            raise ApiError(status, f"WATCH {path}: {getattr(e, 'reason', e)}") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            self._count("WATCH", 0)
            raise ApiError(0, f"WATCH {path}: {type(e).__name__}: {e}") from e
        raw: urllib3.HTTPResponse = resp.response
        self._count("WATCH", raw.status)
        if raw.status >= 400:
            try:
                body = raw.read(64 * 1024)
                obj = json.loads(body) if body else {}
            except (ValueError, urllib3.exceptions.HTTPError, OSError):
                obj = {}
            finally:
                raw.release_conn()
            msg = obj.get("message", "") if isinstance(obj, dict) else ""
            raise ApiError(raw.status, f"WATCH {path}: {msg}", obj if isinstance(obj, dict) else None)
        return WatchStream(raw)

    def patch_node_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """The patched Node; only its metadata (a PartialObjectMetadata) when metadata_answers is set."""
        accept = PARTIAL_METADATA if self.metadata_answers else "application/json"
        return self.request("PATCH", f"/api/v1/nodes/{quote(name)}/status", patch, STRATEGIC_MERGE, accept=accept)

    def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", f"/api/v1/nodes/{quote(name)}", patch, STRATEGIC_MERGE)

    def create_event(self, namespace: str, event: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", f"/apis/events.k8s.io/v1/namespaces/{quote(namespace)}/events", event)

    def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.request(
            "PATCH", f"/apis/events.k8s.io/v1/namespaces/{quote(namespace)}/events/{quote(name)}", patch, MERGE_PATCH
        )


class LineTooLong(ValueError):
    pass


def split_lines(chunks: Iterable[bytes], max_line: int) -> Iterator[bytes]:
    """Newline-delimited records from a byte stream, in linear time; a record longer than `max_line`
    bytes raises LineTooLong instead of growing the buffer without bound. Blank lines are skipped."""
    buf = bytearray()
    for chunk in chunks:
        start = 0
        while True:
            i = chunk.find(b"\n", start)
            if i < 0:
                break
            if len(buf) + (i - start) > max_line:
                raise LineTooLong(f"a watch event over {max_line} bytes")
            buf += chunk[start:i]
            start = i + 1
            if buf.strip():
                yield bytes(buf)
            buf.clear()
        buf += chunk[start:]
        if len(buf) > max_line:
            raise LineTooLong(f"a watch event over {max_line} bytes")
    if buf.strip():
        yield bytes(buf)


class WatchStream:
    """An open watch: `events()` yields the decoded watch events ({"type", "object"}) as they arrive;
    `shutdown()` (from any thread) unblocks a reader within a moment; `close()` releases the socket."""

    def __init__(self, response: urllib3.HTTPResponse) -> None:
        self.response = response
        self.bytes_read = 0

    def _chunks(self) -> Iterator[bytes]:
        r = self.response
        try:
            if r.chunked and r.supports_chunked_reads():
                for chunk in r.stream(WATCH_READ_CHUNK):
                    self.bytes_read += len(chunk)
                    yield chunk
            else:
                while chunk := r.read1(WATCH_READ_CHUNK):
                    self.bytes_read += len(chunk)
                    yield chunk
        except (urllib3.exceptions.HTTPError, OSError, ValueError, AttributeError) as e:
            # AttributeError/ValueError: the socket was shut down or closed under the reader (stop)
            raise ApiError(0, f"watch stream: {type(e).__name__}: {e}") from e

    def events(self, max_line: int = MAX_WATCH_LINE) -> Iterator[dict[str, Any]]:
        """Raises ApiError (status 0) on a broken stream or an undecodable event; LineTooLong on a line
        over max_line bytes. Ends when the server ends the watch."""
        for line in split_lines(self._chunks(), max_line):
            try:
                ev = json.loads(line)
            except ValueError as e:
                raise ApiError(0, f"watch stream: undecodable event ({len(line)} bytes)") from e
            if not isinstance(ev, dict):
                raise ApiError(0, "watch stream: an event that is not an object")
            yield ev

    def shutdown(self) -> None:
        try:
            self.response.shutdown()
        except (ValueError, RuntimeError, OSError, NotImplementedError):
            pass

    def close(self) -> None:
        try:
            self.response.close()
            self.response.release_conn()
        except (urllib3.exceptions.HTTPError, OSError, ValueError):
            pass

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(kubeconfig: str | None, timeout_s: float) -> KubeApi:
    """The API client from a kubeconfig file or the in-cluster config (then ~/.kube/config); a missing or broken
    one is one ConfigError line naming where it looked."""
    from agent.settings import ConfigError

    try:
        return KubeApi.from_environment(kubeconfig, timeout_s)
    except Exception as e:  # the kubernetes package raises several types for a bad kubeconfig
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster or ~/.kube/config credentials"
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"cannot load {where}: {first}") from None
