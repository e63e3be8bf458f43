"""Writes charts/gpu-ready/README.md from the chart: every value of values.schema.json with its type, its default
from values.yaml and its description, and the values files in charts/gpu-ready/examples/ with their first comment
line. `--check` writes nothing and exits 1 when the README is not what this makes (tests/test_chart_readme.py runs
the same comparison).

    python tools/chart_readme.py [--check]      # or: make chart-readme
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "gpu-ready"
README = CHART / "README.md"
DEFAULT_WIDTH = 60  # a default longer than this (as JSON) is shown as "see values.yaml"

HEAD = """# gpu-ready Helm chart

<!-- Made by tools/chart_readme.py from values.schema.json, values.yaml and examples/: edit those and run
     `make chart-readme`; tests/test_chart_readme.py fails when this file is not what the script makes. -->

A per-node DaemonSet that reports whether a node's NVIDIA GPUs are really usable: a Node condition
(`{condition}` by default), Events and Prometheus metrics. Needs Kubernetes {kube}.
The project's docs/deployment.md explains the security model, the values and the alternatives for GPU access.

```sh
helm install gpu-ready oci://<registry>/charts/gpu-ready --version <version> -n gpu-ready --create-namespace
kubectl -n gpu-ready rollout status daemonset/gpu-ready
```

`helm install` and `helm upgrade` check the cluster first and fail with one line when `runtimeClassName` names no
RuntimeClass there or when `serviceMonitor`/`prometheusRule` are enabled without the Prometheus Operator's CRDs.
`helm template` (and a GitOps tool that renders with it, such as Argo CD) cannot see the cluster: it renders
without those checks. As a dependency of an umbrella chart gpu-ready takes `global` and an `enabled` condition key.
"""


def _type(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    t = prop.get("type", "")
    return " \\| ".join(t) if isinstance(t, list) else str(t)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(values: Any, path: list[str]) -> str:
    v: Any = values
    for key in path:
        if not isinstance(v, dict) or key not in v:
            return "unset"
        v = v[key]
    shown = json.dumps(v, separators=(", ", ": "))
    return "see values.yaml" if len(shown) > DEFAULT_WIDTH else f"`{_cell(shown)}`"


def _rows(props: dict[str, Any], values: Any, path: list[str]) -> list[str]:
    rows = []
    for key, prop in props.items():
        here = [*path, key]
        rows.append(f"| `{'.'.join(here)}` | {_type(prop)} | {_default(values, here)} | {_cell(prop['description'])} |")
        rows += _rows(prop.get("properties", {}), values, here)
    return rows


def _title(path: Path) -> str:
    """An example's opening comment up to its first colon outside parentheses."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("# "):
            break
        words.append(line[2:].strip())
    text, depth = " ".join(words), 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ":" and depth == 0:
            return text[:i]
    return text


def _examples() -> list[str]:
    return [
        f"- [`examples/{f.name}`](examples/{f.name}): {_title(f)}" for f in sorted((CHART / "examples").glob("*.yaml"))
    ]


def render() -> str:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    kube = chart["kubeVersion"].replace(">=", "≥ ").replace(".0-0", "")
    parts = [
        HEAD.format(condition=values["conditionType"], kube=kube),
        "## Examples\n",
        "Values files for common clusters, each tested (rendered, linted and dry-run on a real kube-apiserver):\n",
        *_examples(),
        "",
        "## Values\n",
        f"{schema['description']}\n",
        "| key | type | default | description |",
        "|---|---|---|---|",
        *_rows(schema["properties"], values, []),
    ]
    return "\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--check"]:
        if README.read_text() != text:
            print(f"{README} is not what {Path(__file__).name} makes: run make chart-readme", file=sys.stderr)
            return 1
        return 0
    if argv[1:]:
        print("usage: chart_readme.py [--check]", file=sys.stderr)
        return 2
    README.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
