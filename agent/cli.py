"""Command line: `gpu-ready check` (one shot; `--replay` a bundle), `gpu-ready capture` (a bundle of what the checks
read), `gpu-ready run` (the DaemonSet agent), `gpu-ready gpus` (which pods hold which GPU, from kubelet's
pod-resources), `gpu-ready controller` (preflight Jobs and the fleet brake), `gpu-ready preflight` (onboarding
gates), `gpu-ready uninstall` (what the chart's uninstall hook runs)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from agent import __version__
from agent import config as config_mod
from agent.act.fencing.plan import FenceResult, FencingSection, FencingSettings
from agent.act.fencing.reporter import FenceReporter
from agent.allocation import AllocationMap
from agent.checks import CheckSuite
from agent.kernel_log.watcher import KernelLog, place_events, read_once
from agent.kernel_log.xid import KernelLogParser, XidClassifier
from agent.kube.client import ApiError, KubeApi, connect
from agent.logs import setup_logging
from agent.model import Check, LatchedFault, Observation, Status, Verdict, XidEvent
from agent.names import CONDITION_TYPE, NEEDS_PREFLIGHT_LABEL, PREFLIGHT_LABEL, TAINT_KEY
from agent.probes.infiniband import RailReport
from agent.probes.nvml import NvmlProbe, NvmlSnapshot, nvlink_json
from agent.report.blast_radius import gpus_json, render_gpus
from agent.report.condition import on_node, render_on_node
from agent.settings import load_json, read_text_file
from agent.verdict import decide

# `gpu-ready check`'s exit status: the verdict; 2 is kept for a usage or configuration error (argparse's own code,
# and a bad setting, file or --node-json: one line on stderr, no verdict), so a script can tell them apart.
EXIT = {Status.TRUE: 0, Status.FALSE: 1, Status.UNKNOWN: 3}
USAGE_ERROR = 2
CHECK_EPILOG = """exit status: 0 GPUReady=True, 1 False, 3 Unknown (a check could not run), 2 a usage or
configuration error (one line on stderr, no verdict)."""
FLAGS_EPILOG = """A true/false setting is --x or --no-x (--x=false works too). In the chart's pod,
GPU_READY_CONFIG names the agent's settings file: a check run there reads the settings the agent reads. Every
setting: docs/configuration.md."""


def classifier_from(cfg: config_mod.Config) -> XidClassifier:
    return XidClassifier(cfg.xid_fatal, cfg.xid_ignore, cfg.unknown_xid_fatal)


def read_kernel_log(cfg: config_mod.Config) -> KernelLog:
    """Every record in the kernel log once (the whole ring buffer on /dev/kmsg)."""
    return read_once(cfg.kmsg, KernelLogParser(classifier_from(cfg)), cfg.kmsg_trust_user)


def latched_from(log: KernelLog, now: float) -> list[LatchedFault]:
    """A one-shot read's fatal events as the latch would hold them."""
    return [
        LatchedFault(x.xid, x.raw_address, x.address, x.source, x.text, now, x.action) for x in log.events if x.fatal
    ]


def render_table(v: Verdict, xids: list[XidEvent], wide: bool = False) -> str:
    """The per-GPU table; `wide` (-o wide) adds each GPU's remedy, recovery step and the sources that could not
    check it, and keeps long names whole."""
    extra = f"{'REMEDY':<7} {'RECOVERY':<12} {'UNCHECKED':<24} " if wide else ""
    width = max([28, *(len(g.name or "") for g in v.gpus)]) if wide else 28
    out = [f"{'GPU':<4} {'BUS ID':<17} {'NAME':<{width}} {'STATUS':<9} {extra}PROBLEMS"]
    for g in v.gpus:
        st = {True: "healthy", False: "UNHEALTHY", None: "unknown"}[g.healthy]
        idx = "-" if g.index is None else str(g.index)
        more = (
            f"{g.remedy or '-':<7} {g.recovery or '-':<12} {','.join(c.value for c in g.unchecked) or '-':<24} "
            if wide
            else ""
        )
        out.append(
            f"{idx:<4} {g.pci_bus_id:<17} {(g.name or '-')[:width]:<{width}} {st:<9} {more}{'; '.join(g.problems)}"
        )
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


def allocation_of(
    suite: CheckSuite, obs: Observation, cfg: config_mod.Config
) -> tuple[AllocationMap | None, str | None]:
    """The cycle's allocation map, or None and one line saying why (podResources off, or the read failed)."""
    if suite.allocation is not None:
        return suite.allocation, None
    if not cfg.pod_resources:
        return None, "podResources is off"
    why = next((f.message for f in obs.findings if f.kind == "pod_resources_unreadable"), "no answer")
    return None, why.splitlines()[0][:300] if why else "no answer"


MULTINODE = (Check.INFINIBAND, Check.FABRIC, Check.FABRIC_MANAGER, Check.IMEX)


def multinode_json(suite: CheckSuite) -> dict[str, Any]:
    """What the multi-node probes read this cycle, by check (docs/fabric.md): null for one that is off or could not
    read its source (the verdict's message says why)."""
    out: dict[str, Any] = {}
    for check in MULTINODE:
        r = suite.results.get(check)
        p = r.payload if r is not None and r.ran else None
        out[str(check)] = p.to_json() if p is not None and hasattr(p, "to_json") else p
    nvml = suite.results.get(Check.NVML)
    snap = nvml.payload if nvml is not None and nvml.ran else None
    out["nvlink"] = nvlink_json(snap) if isinstance(snap, NvmlSnapshot) else None  # links up, down, fitted per GPU
    return out


def verdict_json(
    v: Verdict,
    xids: list[XidEvent],
    fencing: FenceResult | None = None,
    allocation: tuple[AllocationMap | None, str | None] = (None, "podResources is off"),
    multinode: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`fencing`: the node's DeviceTaintRules and what the agent would change (only with --node); else null.
    `allocation`: the pod-resources map (null when off or unreadable; `allocation_error` says why).
    `multinode`: the rails, the NVLink fabric, the fabric manager and IMEX as read (multinode_json)."""
    amap, why = allocation
    return {
        "status": v.status.value,
        "reason": v.reason.value,
        "message": v.message,
        "gpus": [g.to_json() for g in v.gpus],
        "counts": v.counts.as_dict(),
        "xids": [x.to_json() for x in xids],
        "fencing": fencing.to_json() if fencing is not None else None,
        "allocation": amap.to_json() if amap is not None else None,
        "allocation_error": None if amap is not None else why,
        "multinode": multinode,
    }


def preview_fencing(api: KubeApi, node: str, cfg: config_mod.Config, v: Verdict, suite: CheckSuite) -> FenceResult:
    """The node's DeviceTaintRules as they are and what `gpu-ready run` would change for this verdict (reads
    only: API discovery and one LIST)."""
    settings = FencingSettings.of(cfg[FencingSection], cfg.dra_driver)
    return FenceReporter(api, node, settings).preview(v, suite.inventory)


def render_fencing(f: FenceResult) -> list[str]:
    out = ["", "Fencing: " + (f.summary() or "no device fenced")]
    plan = f.plan
    for what, devices in (
        ("would fence", [d.device for d in plan.create]),
        ("would change", [d.device for _, d in plan.update]),
        ("would unfence", [r.device for r in plan.delete]),
    ):
        if devices:
            out.append(f"  {what}: {', '.join(devices)}")
    out += [f"  {line}" for line in (*plan.notes, *f.errors, *([f.unsupported] if f.unsupported else []))]
    return out


NODE_JSON_LIMIT = 16 << 20  # bytes; a Node object is a few KiB


def read_node_json(path: str) -> dict[str, Any]:
    """A saved `kubectl get node -o json`; ValueError (one line) when it is not a Node-shaped object."""
    try:
        text = read_text_file(path, NODE_JSON_LIMIT)  # a FIFO or a device is refused, never waited on
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(getattr(e, "strerror", None) or str(e)) from None
    try:
        node = load_json(text)
    except ValueError as e:
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


OBJECT_OUTPUTS = ("json", "yaml")


def add_output_flags(p: argparse.ArgumentParser) -> None:
    """kubectl's -o: json or yaml print one object (the same fields), wide the table with more columns; --json is
    -o json."""
    p.add_argument(
        "-o",
        "--output",
        choices=("json", "yaml", "wide"),
        default=None,
        help="json or yaml: one object; wide: the table with more columns (default: the table)",
    )
    p.add_argument("--json", dest="output", action="store_const", const="json", help="the same as -o json")


def print_object(obj: dict[str, Any], fmt: str) -> None:
    if fmt == "yaml":
        import yaml

        print(yaml.safe_dump(obj, sort_keys=False, default_flow_style=False), end="")
    else:
        print(json.dumps(obj, indent=2))


def judge_once(
    cfg: config_mod.Config,
    node: dict[str, Any] | None = None,
    node_error: str | None = None,
    api: KubeApi | None = None,
    *,
    nvml: NvmlProbe | None = None,
    attach: Callable[[CheckSuite], None] | None = None,
) -> tuple[Verdict, list[XidEvent], CheckSuite, Observation]:
    """One check cycle as `check` runs it: the kernel log read once, every probe, decide(). `nvml` and `attach` (which
    may rewire the suite's programs) are the seams `capture` records through and `check --replay` replays through."""
    log = read_kernel_log(cfg)
    suite = CheckSuite(cfg, nvml=nvml, api=api if node is not None else None, kernel_log=lambda: log.problem)
    if attach is not None:
        attach(suite)
    xids = log.events
    # The Xid rate over the log read once: each event at its kernel-log time.
    suite.xid_rate.observe_at(place_events(xids, device=log.device, now=suite.clock(), newest_usec=log.newest_usec))
    obs, _stats = suite.run(node, node_error, one_shot=True)
    obs.xids = xids
    return decide(obs, latched_from(log, time.time())), xids, suite, obs


def cmd_replay(args: argparse.Namespace) -> int:
    """`check --replay`: the bundle opened (one line and exit 2 when it cannot be), judged by cmd_check, cleaned up."""
    from agent.bundle import BundleError
    from agent.replay import open_replay, print_report

    try:
        args.replay_session = open_replay(args, args.replay)
    except BundleError as e:
        print(f"gpu-ready: cannot replay {args.replay}: {' '.join(str(e).split())}", file=sys.stderr)
        return USAGE_ERROR
    try:
        print_report(args.replay_session.report())
        rc = cmd_check(args)
        print_report(args.replay_session.report_after())
        return rc
    finally:
        args.replay_session.close()


def cmd_check(args: argparse.Namespace) -> int:
    """Exit EXIT[verdict]; USAGE_ERROR (2) with one line for a bad setting, kubeconfig or --node-json."""
    if getattr(args, "replay", None) and getattr(args, "replay_session", None) is None:
        return cmd_replay(args)
    replay = getattr(args, "replay_session", None)
    if args.node:
        args.node_name = args.node  # the node_name setting (`run --node`): dcgm-exporter's host, the slices
    cfg = replay.cfg if replay is not None else config_mod.load(args)
    setup_logging(cfg.log_format, cfg.log_level)
    node: dict[str, Any] | None = None
    node_error: str | None = None
    api: KubeApi | None = None
    if args.node_json:
        try:
            node = read_node_json(args.node_json)
        except ValueError as e:
            print(f"gpu-ready: cannot read --node-json {args.node_json}: {e}", file=sys.stderr)
            return USAGE_ERROR
    elif args.node:
        api = connect(cfg.kubeconfig, cfg.api_timeout)  # no credentials: ConfigError, as for `run`
        try:
            node = api.get_node(args.node)  # the ResourceSlices are read too (dra_counting), in suite.run
        except ApiError as e:
            if e.status == 404:  # a typo is a usage error, not a node that could not be checked
                print(f"gpu-ready: --node {args.node}: no such Node in this cluster", file=sys.stderr)
                return USAGE_ERROR
            node_error = str(e)
    elif replay is not None:
        node = replay.node  # the bundle's node.json, when it has one
    v, xids, suite, obs = judge_once(
        cfg,
        node,
        node_error,
        api,
        nvml=replay.nvml if replay is not None else None,
        attach=replay.attach if replay is not None else None,
    )
    fencing = preview_fencing(api, args.node, cfg, v, suite) if api is not None and node is not None else None
    shown = on_node(node, cfg.condition_type, cfg.taint_key) if node is not None else None
    if args.output in OBJECT_OUTPUTS:
        body = verdict_json(v, xids, fencing, allocation_of(suite, obs, cfg), multinode_json(suite))
        print_object({**body, "node": shown}, args.output)
    else:
        lines = [render_table(v, xids, wide=args.output == "wide"), *(render_on_node(shown) if shown else [])]
        print("\n".join([*lines, *(render_fencing(fencing) if fencing is not None else [])]))
    return EXIT[v.status]


def cmd_gpus(args: argparse.Namespace) -> int:
    """One read of pod-resources plus the GPU inventory (the same code path as `check`): the table or JSON. Exit 2
    with one line when pod-resources cannot be read; 0 otherwise (health is shown, not the exit code)."""
    cfg = config_mod.load(args, overrides={"pod_resources": True})
    setup_logging(cfg.log_format, cfg.log_level)
    log = read_kernel_log(cfg)  # a GPU with a fatal Xid in this boot's log is shown UNHEALTHY, as `check` does
    suite = CheckSuite(cfg, kernel_log=lambda: log.problem)
    obs, _stats = suite.run(None, None, one_shot=True)
    amap, why = allocation_of(suite, obs, cfg)
    if amap is None:
        print(f"gpu-ready: cannot read pod-resources at {cfg.pod_resources_socket}: {why}", file=sys.stderr)
        return 2
    v = decide(obs, latched_from(log, time.time()))
    rails = suite.results.get(Check.INFINIBAND)
    rail_view = rails.payload if rails is not None and isinstance(rails.payload, RailReport) else None
    if args.output in OBJECT_OUTPUTS:
        print_object(gpus_json(amap, v, rail_view), args.output)
    else:
        print(render_gpus(amap, v, rail_view, wide=args.output == "wide"))
    return 0


def add_uninstall_arguments(u: argparse.ArgumentParser) -> None:
    u.add_argument("--namespace", required=True, help="the release namespace (the brake, the Lease, the Jobs)")
    u.add_argument("--condition-type", default=CONDITION_TYPE, help="the agent's node condition (default: %(default)s)")
    u.add_argument("--taint-key", default=TAINT_KEY, help="the agent's taint (default: %(default)s)")
    u.add_argument("--preflight-label", default=PREFLIGHT_LABEL, help="preflight's result label (default: %(default)s)")
    u.add_argument(
        "--needs-label", default=NEEDS_PREFLIGHT_LABEL, help="the needs-preflight label (default: %(default)s)"
    )
    u.add_argument("--brake-name", default="", help="the brake ConfigMap to delete (default: none)")
    u.add_argument("--lease-name", default="", help="the controller's Lease to delete (default: none)")
    u.add_argument("--pod-selector", default="", help="wait until no pod of the release matches (default: no wait)")
    u.add_argument(
        "--wait", type=float, default=120.0, help="at most this many seconds for that (default: %(default)s)"
    )
    u.add_argument(
        "--keep-history",
        action="store_true",
        help="keep preflight's labels, its time and report annotations and the finished Jobs (default: remove them)",
    )
    u.add_argument("--kubeconfig", default=None, help="a kubeconfig file (default: in-cluster, then ~/.kube/config)")


def cmd_uninstall(args: argparse.Namespace) -> int:
    from agent.act.uninstall import Uninstall, UninstallSettings

    api = connect(args.kubeconfig, 10.0)
    s = UninstallSettings(
        args.namespace, args.condition_type, args.taint_key, args.preflight_label, args.needs_label,
        args.brake_name, args.lease_name, args.pod_selector, args.keep_history, args.wait,
    )  # fmt: skip
    try:
        return Uninstall(api, s, lambda line: print(line, flush=True)).run()
    finally:
        api.close()


class OneLineParser(argparse.ArgumentParser):
    """A usage error (unknown flag, missing subcommand or value, bad choice, exclusive flags) is one line on
    stderr, `gpu-ready <cmd>: error: <message>`, and exit 2; `--help` still prints the whole help (a true/false
    flag shown as `--x, --no-x`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", config_mod.HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {' '.join(message.split())}\n")


def command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The subcommand's own parser (the top-level one when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            found: argparse.ArgumentParser = action.choices[command]
            return found
    return parser


def build_parser(with_preflight: bool = True, argv: list[str] | None = None) -> argparse.ArgumentParser:
    """`with_preflight`: the preflight subcommand's own flags (they import agent.preflight: `run` and `check`
    go without it)."""
    p = OneLineParser(prog="gpu-ready", description=__doc__)
    p.add_argument("--version", action="version", version=f"gpu-ready {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    c = sub.add_parser(
        "check",
        help="run every check once and print the verdict (exit 0 True, 1 False, 3 Unknown; 2 usage or configuration "
        "error)",
        usage="%(prog)s [--node NODE | --node-json NODE_JSON | --replay BUNDLE] [-o json|yaml|wide] [--config CONFIG] "
        "[settings]",
        description="Run every check once and print the per-GPU table and the verdict (-o json or yaml: one "
        "object; -o wide: more columns).",
        epilog=f"{CHECK_EPILOG}\n\n{FLAGS_EPILOG}",
    )
    src = c.add_mutually_exclusive_group()
    src.add_argument("--node", help="read this Node through the API (in-cluster config or kubeconfig)")
    src.add_argument("--node-json", help="a saved `kubectl get node -o json`")
    src.add_argument("--replay", metavar="BUNDLE", help="judge a bundle from `gpu-ready capture` (folder or .tar.gz)")
    add_output_flags(c)
    config_mod.add_flags(c, "check")
    c.set_defaults(func=cmd_check)
    cap = sub.add_parser(
        "capture",
        help="write a bundle of everything the checks read on this node (for `check --replay`)",
        usage="%(prog)s [-o BUNDLE] [--no-redact] [--node-json NODE_JSON] [--config CONFIG] [settings]",
        description="Judge the node once, recording every reading, and write one bundle (a folder or .tar.gz) of it "
        "with the raw nvidia-smi views, the sysfs subset, the device nodes and the kernel log; host names, serials, "
        "UUIDs and addresses redacted. Exit 0, or 2 with one line.",
        epilog=FLAGS_EPILOG,
    )
    if wants_command(argv, "capture"):  # its module (tar, the bundle code) is not loaded by `run` or `check`
        from agent.capture import add_arguments as capture_arguments

        capture_arguments(cap)
        config_mod.add_flags(cap, "check")
    cap.set_defaults(
        func=lambda a: __import__("agent.capture", fromlist=["cmd_capture"]).cmd_capture(a, judge_once, read_node_json)
    )
    g = sub.add_parser(
        "gpus",
        help="which pods hold which GPU (kubelet pod-resources): a table of every GPU and a summary line",
        usage="%(prog)s [-o json|yaml|wide] [--config CONFIG] [settings]",
        description="Which pods hold which GPU (kubelet's pod-resources) and each GPU's health; exit 0, or 2 "
        "with one line when pod-resources cannot be read.",
        epilog=FLAGS_EPILOG,
    )
    add_output_flags(g)
    config_mod.add_flags(g, "gpus")
    g.set_defaults(func=cmd_gpus)
    r = sub.add_parser(
        "run",
        help="the DaemonSet agent: check every poll, patch GPUReady, emit Events, serve /metrics",
        usage="%(prog)s [--node NODE] [--config CONFIG] [settings]",
        description="The DaemonSet agent: check every poll, patch the GPUReady condition, emit Events, serve "
        "/metrics, /healthz and /readyz.",
        epilog=FLAGS_EPILOG,
    )
    config_mod.add_flags(r, "run")
    r.set_defaults(func=_run)
    ct = sub.add_parser(
        "controller",
        help="run preflight Jobs where needed (needs-preflight label) and publish the fleet brake (a Deployment)",
        description="One active replica (a Lease): creates the chart's preflight Job on each GPU node labelled "
        "needs-preflight, within maxConcurrent, a per-node backoff and a retry cap, and publishes the fleet brake. "
        "Exit 2 with one line on a bad flag or template.",
    )
    ct.set_defaults(func=lambda a: __import__("agent.controller", fromlist=["main"]).main(a))
    if wants_command(argv, "controller"):
        from agent.controller import add_arguments as controller_arguments

        controller_arguments(ct)
        complete_help(ct)
    u = sub.add_parser(
        "uninstall",
        help="remove what gpu-ready wrote to Nodes and the cluster (the chart's uninstall hook runs it)",
        description="Remove gpu-ready's condition, taint, labels and annotations from every Node, its "
        "DeviceTaintRules, the brake ConfigMap, the controller's Lease and its preflight Jobs (docs/deployment.md"
        "#uninstall). Exit 0 when nothing is left, 1 when something could not be removed, 2 on a usage error.",
    )
    add_uninstall_arguments(u)
    complete_help(u)
    u.set_defaults(func=cmd_uninstall)
    pf = sub.add_parser("preflight", help="run the onboarding gates and label the Node")
    pf.set_defaults(func=lambda a: __import__("agent.preflight", fromlist=["main"]).main(a))
    if with_preflight:
        try:
            from agent.preflight import add_arguments

            add_arguments(pf)
            complete_help(pf)
        except ImportError:
            pass
    return p


def complete_help(p: argparse.ArgumentParser) -> None:
    """Every flag of `p` says what it means and its default in --help (argparse shows neither by itself)."""
    for a in p._actions:
        if a.help == argparse.SUPPRESS or not a.option_strings or a.dest == "help":
            continue
        a.help = a.help or a.dest.replace("_", " ")  # the controller's and preflight's rows carry their help
        default = '""' if a.default == "" else a.default
        shown = "required" if a.required else None if a.default in (None, False) else f"default: {default}"
        if shown and "default" not in a.help and "required" not in a.help:
            a.help = f"{a.help} ({shown})".replace("%", "%%")


def wants_command(argv: list[str] | None, command: str) -> bool:
    """`command` is named (the first word that is not an option), or no command is (help); None: always."""
    if argv is None:
        return True
    words = [a for a in argv if not a.startswith("-")]
    return not words or words[0] == command


def wants_preflight(argv: list[str]) -> bool:
    """The command is `preflight` (the first word that is not an option), or no command is named (help)."""
    words = [a for a in argv if not a.startswith("-")]
    return not words or words[0] == "preflight"


def _run(args: argparse.Namespace) -> int:
    from agent.runner import main as run_main

    return run_main(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(with_preflight=wants_preflight(argv), argv=argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand's parser: `gpu-ready check: error: unrecognized arguments: --x`
        command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        setup_logging()  # `check` and `run` set it again from their settings (flag, env or file)
        return int(args.func(args))
    except config_mod.ConfigError as e:
        print(f"gpu-ready: configuration error: {e}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
