"""A small JSON client on top of the official `kubernetes` package's ApiClient (auth, TLS, kubeconfig
and in-cluster config come from it). Raw dicts instead of the generated models keep the hot path
cheap; every request is counted for the metrics by an optional callback."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import kubernetes
import urllib3
from kubernetes.client import ApiClient, Configuration

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    """An API request failed. status 0 = no HTTP answer (connection refused, timeout, TLS)."""

    def __init__(self, status: int, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.body = body or {}


class KubeApi:
    def __init__(
        self,
        configuration: Configuration,
        timeout_s: float = 10.0,
        on_request: Callable[[str, int], None] | None = None,
    ) -> None:
        configuration.retries = False  # retries are ours (backoff with jitter in the runner)
        self.configuration = configuration
        self.api = ApiClient(configuration)
        self.timeout_s = timeout_s
        self.on_request = on_request

    @classmethod
    def from_environment(
        cls,
        kubeconfig: str | None = None,
        timeout_s: float = 10.0,
        on_request: Callable[[str, int], None] | None = None,
    ) -> KubeApi:
        cfg = Configuration()
        if kubeconfig:
            kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            try:
                kubernetes.config.load_incluster_config(client_configuration=cfg)
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config(client_configuration=cfg)
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
        cfg = Configuration(host=host)
        cfg.api_key = {"authorization": f"Bearer {token}"}
        if ca_file:
            cfg.ssl_ca_cert = ca_file
        else:
            cfg.verify_ssl = False
        return cls(cfg, timeout_s, on_request)

    def close(self) -> None:
        self.api.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        m, url, hdrs, data, _ = self.api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        status = 0
        try:
            resp = self.api.call_api(m, url, hdrs, data, _request_timeout=timeout_s or self.timeout_s)
            resp.read()
            status = resp.status
            raw = resp.data or b"{}"
        except kubernetes.client.exceptions.ApiException as e:
            status = e.status or 0
            raw = (e.body or "").encode() if isinstance(e.body, str) else (e.body or b"")
        except (urllib3.exceptions.HTTPError, OSError) as e:
            self._count(method, 0)
            raise ApiError(0, f"{method} {path}: {type(e).__name__}: {e}") from e
        self._count(method, status)
        try:
            obj = json.loads(raw) if raw else {}
        except ValueError:
            obj = {"message": raw[:200].decode("utf-8", "replace")}
        if status >= 400:
            raise ApiError(status, f"{method} {path}: {obj.get('message', '')}", obj)
        return obj

    def _count(self, verb: str, code: int) -> None:
        if self.on_request is not None:
            self.on_request(verb, code)

    # -- the calls the agent makes --------------------------------------------------------------

    def get_node(self, name: str) -> dict[str, Any]:
        return self.request("GET", f"/api/v1/nodes/{quote(name)}")

    def patch_node_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", f"/api/v1/nodes/{quote(name)}/status", patch, STRATEGIC_MERGE)

    def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", f"/api/v1/nodes/{quote(name)}", patch, STRATEGIC_MERGE)

    def create_event(self, namespace: str, event: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", f"/apis/events.k8s.io/v1/namespaces/{quote(namespace)}/events", event)

    def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.request(
            "PATCH", f"/apis/events.k8s.io/v1/namespaces/{quote(namespace)}/events/{quote(name)}", patch, MERGE_PATCH
        )
