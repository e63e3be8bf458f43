"""The node corpus (tests/fixtures/nodes/): every bundle replayed, its verdict beside what its bundle.json expects,
the counts of healthy and broken nodes per configuration, and the coverage table in docs/corpus.md (model x signal),
which `make docs` writes and tests/test_corpus.py checks is current.

A node's configuration is bundle.json's `configuration` when it has one, else the one nodes/README.md's node table
gives it (`| `<node>` | <configuration> | ...`), else the GPU model(s) the replay found (NVML's names, else
nvidia-smi's), else "model not named"."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.bundle import BundleError, load
from agent.model import Check
from agent.replay import open_replay

ROOT = Path(__file__).resolve().parent.parent
NODES = ROOT / "tests" / "fixtures" / "nodes"
DOC = ROOT / "docs" / "corpus.md"
BEGIN, END = "<!-- corpus table: begin (make docs) -->", "<!-- corpus table: end -->"
SUMMARY = pytest.StashKey[list[str]]()  # the counts table, printed at the end of the test run (tests/conftest.py)
# Signals, each shown where a node's bundle carries the files that feed it.
SIGNALS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nvidia-smi", ("nvidia-smi.txt", "runs.json")),
    ("-q / NVML", ("nvidia-smi-q.txt", "nvidia-smi-q.xml", "nvml.json")),
    ("NVLink", ("nvlink-s.txt",)),
    ("rails", ("ibstat.txt", "ibv_devinfo.txt", "sys-class-infiniband.txt", "sys/class/infiniband")),
    ("PCI", ("lspci.txt", "sys/bus/pci/devices")),
    ("kernel log", ("dmesg.txt", "kmsg.txt")),
    ("device nodes", ("dev.json",)),
)


@dataclass
class NodeResult:
    name: str
    configuration: str
    expect: dict[str, Any]
    status: str
    reason: str
    message: str
    signals: tuple[str, ...]
    skipped: list[str] = field(default_factory=list)
    xfail: str | None = None

    @property
    def healthy(self) -> bool:
        return self.expect.get("status") == "True"

    def mismatch(self) -> str | None:
        """None when the verdict is what bundle.json expects; else what differs."""
        want = self.expect
        if want.get("status") != self.status:
            return f"status {self.status} ({self.reason}), expected {want.get('status')} ({want.get('reason')})"
        if want.get("reason") and want["reason"] != self.reason:
            return f"reason {self.reason}, expected {want['reason']}"
        missing = [f for f in want.get("findings", []) if f not in self.message]
        if missing:
            return f"message lacks {missing}"
        return None


def readme_configurations(root: Path = NODES) -> dict[str, str]:
    """nodes/README.md's node table: node name -> configuration."""
    try:
        text = (root / "README.md").read_text(encoding="utf-8")
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`") and cells[0].endswith("`") and cells[1]:
            out.setdefault(cells[0].strip("`"), cells[1])
    return out


def node_dirs(root: Path = NODES) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "bundle.json").is_file())


def replay_node(path: Path) -> NodeResult:
    """One node replayed as `gpu-ready check --replay <node>` judges it (its settings, no flags)."""
    from agent.cli import judge_once

    try:
        r = open_replay(argparse.Namespace(config=None), str(path))
    except BundleError as e:
        meta = load(str(path)).meta
        return NodeResult(
            path.name,
            str(meta.get("configuration") or readme_configurations(path.parent).get(path.name) or "model not named"),
            dict(meta.get("expect") or {}),
            "not replayable",
            "",
            str(e),
            signals_of(path),
        )
    try:
        v, _, suite, _ = judge_once(r.cfg, r.node, None, None, nvml=r.nvml, attach=r.attach)
    finally:
        r.close()
    meta = r.bundle.meta
    # NVML's names are whole (the table cuts long ones to 28 characters with "...").
    snap = suite.results[Check.NVML].payload if Check.NVML in suite.results else None
    names = sorted({g.name for g in getattr(snap, "gpus", None) or () if g.name})
    names = names or sorted({g.name for g in v.gpus if g.name})
    config = (
        meta.get("configuration")
        or readme_configurations(path.parent).get(path.name)
        or (", ".join(names) if names else "model not named")
    )
    return NodeResult(
        path.name,
        str(config),
        dict(meta.get("expect") or {}),
        v.status.value,
        v.reason.value,
        v.message,
        signals_of(path),
        [c.value for c in r.skipped],
        meta.get("xfail"),
    )


def signals_of(path: Path) -> tuple[str, ...]:
    b = load(str(path))
    out = []
    for signal, names in SIGNALS:
        if any(n in b.files or b.has_tree(n) for n in names):
            out.append(signal)
    return tuple(out)


def counts_table(results: Iterable[NodeResult]) -> list[str]:
    """Healthy and broken nodes per configuration, and in all."""
    by: dict[str, list[int]] = {}
    for r in results:
        row = by.setdefault(r.configuration, [0, 0])
        row[0 if r.healthy else 1] += 1
    width = max([len(k) for k in by] + [13])
    lines = [f"{'configuration':<{width}}  healthy  broken"]
    for k in sorted(by):
        lines.append(f"{k:<{width}}  {by[k][0]:>7}  {by[k][1]:>6}")
    h, b = sum(v[0] for v in by.values()), sum(v[1] for v in by.values())
    lines.append(f"{'all (' + str(len(by)) + ' configurations)':<{width}}  {h:>7}  {b:>6}")
    return lines


def coverage_table(results: Iterable[NodeResult]) -> str:
    """docs/corpus.md's table: per configuration, the nodes (healthy/broken), the signals their bundles carry (how
    many nodes carry each) and the reasons judged."""
    rows: dict[str, dict[str, Any]] = {}
    for r in results:
        row = rows.setdefault(r.configuration, {"h": 0, "b": 0, "signals": {}, "reasons": set()})
        row["h" if r.healthy else "b"] += 1
        for s in r.signals:
            row["signals"][s] = row["signals"].get(s, 0) + 1
        row["reasons"].add(r.expect.get("reason") or r.expect.get("status", "?"))
    head = ["Configuration", "Healthy", "Broken", *(s for s, _ in SIGNALS), "Verdicts"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in sorted(rows):
        row = rows[k]
        cells = [str(row["signals"].get(s, "")) for s, _ in SIGNALS]
        out.append(
            "| "
            + " | ".join([k.replace("|", "/"), str(row["h"]), str(row["b"]), *cells, ", ".join(sorted(row["reasons"]))])
            + " |"
        )
    total_h = sum(r["h"] for r in rows.values())
    total_b = sum(r["b"] for r in rows.values())
    out.append(f"\n{total_h + total_b} nodes: {total_h} healthy, {total_b} broken, {len(rows)} configurations.")
    return "\n".join(out) + "\n"


def render_doc(current: str, table: str) -> str:
    start, end = current.index(BEGIN) + len(BEGIN), current.index(END)
    return current[:start] + "\n" + table + current[end:]


def write_doc(path: Path = DOC) -> bool:
    """Writes the coverage table into docs/corpus.md; True when it changed."""
    table = coverage_table(replay_node(p) for p in node_dirs())
    old = path.read_text(encoding="utf-8")
    new = render_doc(old, table)
    if new != old:
        path.write_text(new, encoding="utf-8")
    return new != old


if __name__ == "__main__":
    os.chdir(ROOT)
    changed = write_doc()
    print(f"{DOC.relative_to(ROOT)}: {'written' if changed else 'current'}", file=sys.stderr)
