"""Writes deploy/ from the Helm chart, for clusters installed without Helm (`kubectl apply -f`, a GitOps tool that
applies plain manifests, a Prometheus or Grafana set up by hand):

- deploy/gpu-ready.yaml: the Namespace `gpu-ready` (PodSecurity `privileged`: the agent mounts host paths), then
  `helm template gpu-ready charts/gpu-ready --namespace gpu-ready --no-hooks` with the chart's default values;
- deploy/prometheus/gpu-ready.rules.yaml and deploy/grafana/gpu-ready-dashboard.json: the chart's files/ copies.

`--check` writes nothing and exits 1 when deploy/ is not what this makes (tests/test_deploy.py runs the same
comparison with the repository's helm).

    python tools/deploy_manifests.py --helm <path to helm> [--check]      # or: make deploy
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "gpu-ready"
DEPLOY = ROOT / "deploy"
RELEASE = NAMESPACE = "gpu-ready"
MANIFEST = "gpu-ready.yaml"
# deploy/ path -> the chart's file it copies
COPIES = {
    "prometheus/gpu-ready.rules.yaml": "files/gpu-ready.rules.yaml",
    "grafana/gpu-ready-dashboard.json": "files/gpu-ready-dashboard.json",
}

HEAD = f"""# gpu-ready for `kubectl apply -f`, made by `make deploy` (tools/deploy_manifests.py) from charts/gpu-ready
# with the chart's default values; do not edit (tests/test_deploy.py fails when this file lags the chart). It is
#   helm template {RELEASE} charts/gpu-ready --namespace {NAMESPACE} --no-hooks
# after the Namespace below. Other values: run that command with `-f your-values.yaml` (charts/gpu-ready/README.md
# lists every value), or install with Helm (docs/deployment.md). Without Helm's hooks there is no post-delete
# cleanup: after `kubectl delete -f`, `gpu-ready uninstall --namespace {NAMESPACE}` removes what the agent left on
# the Nodes (docs/deployment.md#uninstall).
---
apiVersion: v1
kind: Namespace
metadata:
  name: {NAMESPACE}
  labels:
    # the agent's pods mount host paths and run privileged
    pod-security.kubernetes.io/enforce: privileged
"""


def render(helm: str) -> dict[str, str]:
    """deploy/'s files (path relative to deploy/ -> text) as the chart makes them with `helm`."""
    try:
        r = subprocess.run(
            [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--no-hooks"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except OSError as e:
        raise SystemExit(f"cannot run helm ({helm}): {e.strerror}; make testbin builds one") from None
    if r.returncode != 0:
        raise SystemExit(f"helm template failed: {r.stderr.strip()}")
    out = {MANIFEST: HEAD + r.stdout}
    out.update({dest: (CHART / src).read_text() for dest, src in COPIES.items()})
    return out


def stale(files: dict[str, str]) -> list[str]:
    """deploy/'s files that are missing or differ from `files`."""
    return [p for p, text in files.items() if not (DEPLOY / p).exists() or (DEPLOY / p).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write deploy/ from charts/gpu-ready.")
    ap.add_argument("--helm", default="helm", help="the helm binary (default: helm on PATH)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when deploy/ lags the chart")
    args = ap.parse_args(argv)
    files = render(args.helm)
    if args.check:
        lagging = stale(files)
        if lagging:
            print(f"deploy/ lags the chart ({', '.join(lagging)}): run `make deploy`", file=sys.stderr)
        return 1 if lagging else 0
    for p, text in files.items():
        (DEPLOY / p).parent.mkdir(parents=True, exist_ok=True)
        (DEPLOY / p).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
