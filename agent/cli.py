"""Command line: `gpu-ready check` (one shot), `gpu-ready run` (the DaemonSet agent),
`gpu-ready preflight` (onboarding gates)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from agent import __version__
from agent import config as config_mod
from agent.checks import CheckSuite
from agent.kube import ApiError, KubeApi
from agent.logs import setup_logging
from agent.model import Check, Finding, LatchedFault, Status, Verdict, XidEvent
from agent.probes.kmsg import KmsgSource, KmsgUnavailable
from agent.verdict import decide
from agent.xid import KernelLogParser, XidClassifier

EXIT = {Status.TRUE: 0, Status.FALSE: 1, Status.UNKNOWN: 2}
CHECK_FLAGS = (
    "nvidia_smi",
    "nvidia_smi_timeout",
    "sysfs_root",
    "kmsg",
    "kmsg_trust_user",
    "nvml",
    "nvml_timeout",
    "nvml_nvlink",
    "expected_gpus",
    "xid_fatal",
    "xid_ignore",
    "unknown_xid_fatal",
    "mig_strategy",
    "replicas",
    "kubeconfig",
    "api_timeout",
    "log_format",
    "log_level",
)


def classifier_from(cfg: config_mod.Config) -> XidClassifier:
    return XidClassifier(cfg.xid_fatal, cfg.xid_ignore, cfg.unknown_xid_fatal)


def read_kernel_log(cfg: config_mod.Config) -> tuple[list[XidEvent], Finding | None]:
    """Reads every record in the kernel log once (the whole ring buffer on /dev/kmsg)."""
    src = KmsgSource(cfg.kmsg, trust_user=cfg.kmsg_trust_user)
    parser = KernelLogParser(classifier_from(cfg))
    events: list[XidEvent] = []
    try:
        src.open()
        for records in src.drain():
            for r in records:
                events += parser.feed(r.text, r.seq, r.usec)
    except KmsgUnavailable as e:
        return events, Finding.unchecked(Check.XID, str(e), kind="kmsg_unavailable")
    finally:
        src.close()
    return events, None


def render_table(v: Verdict, xids: list[XidEvent]) -> str:
    out = [f"{'GPU':<4} {'BUS ID':<17} {'NAME':<28} {'STATUS':<9} PROBLEMS"]
    for g in v.gpus:
        st = {True: "healthy", False: "UNHEALTHY", None: "unknown"}[g.healthy]
        idx = "-" if g.index is None else str(g.index)
        out.append(f"{idx:<4} {g.pci_bus_id:<17} {(g.name or '-')[:28]:<28} {st:<9} {'; '.join(g.problems)}")
    if not v.gpus:
        out.append("(no GPUs found)")
    fatal = [x for x in xids if x.fatal]
    if xids:
        out.append("")
        out.append(f"Kernel log: {len(xids)} GPU error records, {len(fatal)} fatal")
        seen: set[tuple[int, str, bool]] = set()
        for x in xids:
            k = (x.xid, x.raw_address, x.fatal)
            if k in seen:
                continue
            seen.add(k)
            kind = {"sxid": "SXid"}.get(x.source, "Xid")
            out.append(f"  {kind} {x.xid:<4} {x.raw_address:<15} {'FATAL' if x.fatal else 'non-fatal':<9} {x.name}")
    c = v.counts
    out.append("")
    out.append("Counts: " + ", ".join(f"{k}={'-' if n is None else n}" for k, n in c.as_dict().items()))
    out.append(f"GPUReady={v.status.value}  reason={v.reason.value}")
    out.append(f"  {v.message}")
    return "\n".join(out)


def verdict_json(v: Verdict, xids: list[XidEvent]) -> dict[str, Any]:
    return {
        "status": v.status.value,
        "reason": v.reason.value,
        "message": v.message,
        "gpus": [g.to_json() for g in v.gpus],
        "counts": v.counts.as_dict(),
        "xids": [x.to_json() for x in xids],
    }


NODE_JSON_LIMIT = 16 << 20  # bytes; a Node object is a few KiB


def read_node_json(path: str) -> dict[str, Any]:
    """A saved `kubectl get node -o json`; ValueError (one line) when it is not a Node-shaped object."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(NODE_JSON_LIMIT + 1)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(getattr(e, "strerror", None) or str(e)) from None
    if len(text) > NODE_JSON_LIMIT:
        raise ValueError(f"larger than {NODE_JSON_LIMIT} bytes")
    try:
        node = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON: {str(e)[:100]}") from None
    if not isinstance(node, dict) or node.get("kind") not in (None, "Node"):
        raise ValueError("not a Node object")
    for part, keys in (("metadata", ("labels", "annotations")), ("status", ("capacity", "allocatable"))):
        sub = node.get(part)
        if sub is None:
            continue
        if not isinstance(sub, dict):
            raise ValueError(f"{part} is not an object")
        for k in keys:
            if sub.get(k) is not None and not isinstance(sub[k], dict):
                raise ValueError(f"{part}.{k} is not an object")
    return node


def cmd_check(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args)
    setup_logging(cfg.log_format, cfg.log_level)
    node: dict[str, Any] | None = None
    node_error: str | None = None
    if args.node_json:
        try:
            node = read_node_json(args.node_json)
        except ValueError as e:
            print(f"gpu-ready: cannot read --node-json {args.node_json}: {e}", file=sys.stderr)
            return 2
    elif args.node:
        try:
            api = KubeApi.from_environment(cfg.kubeconfig, cfg.api_timeout)
            node = api.get_node(args.node)
        except ApiError as e:
            node_error = str(e)
        except Exception as e:  # kubeconfig missing or unreadable
            node_error = f"{type(e).__name__}: {e}"
    suite = CheckSuite(cfg)
    obs, _stats = suite.run(node, node_error, plugin_grace_s=0.0)
    xids, kmsg_problem = read_kernel_log(cfg)
    if kmsg_problem is not None:
        obs.findings.append(kmsg_problem)
    now = time.time()
    latched = [LatchedFault(x.xid, x.raw_address, x.address, x.source, x.text, now) for x in xids if x.fatal]
    obs.xids = xids
    v = decide(obs, latched)
    if args.json:
        print(json.dumps(verdict_json(v, xids), indent=2))
    else:
        print(render_table(v, xids))
    return EXIT[v.status]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu-ready", description=__doc__)
    p.add_argument("--version", action="version", version=f"gpu-ready {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="run every check once and print the verdict (exit 0 True, 1 False, 2 Unknown)")
    config_mod.add_flags(c, CHECK_FLAGS)
    src = c.add_mutually_exclusive_group()
    src.add_argument("--node", help="read this Node through the API (in-cluster config or kubeconfig)")
    src.add_argument("--node-json", help="a saved `kubectl get node -o json`")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_check)
    r = sub.add_parser("run", help="the DaemonSet agent: check every poll, patch GPUReady, emit Events, serve /metrics")
    config_mod.add_flags(r)
    r.set_defaults(func=_run)
    pf = sub.add_parser("preflight", help="run the onboarding gates and label the Node")
    pf.set_defaults(func=lambda a: __import__("agent.preflight", fromlist=["main"]).main(a))
    try:
        from agent.preflight import add_arguments

        add_arguments(pf)
    except ImportError:
        pass
    return p


def _run(args: argparse.Namespace) -> int:
    from agent.runner import main as run_main

    return run_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        setup_logging()  # `check` and `run` set it again from their settings (flag, env or file)
        return int(args.func(args))
    except config_mod.ConfigError as e:
        print(f"gpu-ready: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
