"""`gpu-ready preflight`: argument parsing and the steps. `--step all` (the default) cordons, runs the gates
and records the outcome in one process; the chart's Job runs `cordon`, `gates` and `record` as three
containers so that the gates (third-party burn-in and serving commands) never hold the Node credentials."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import textwrap
from dataclasses import asdict, dataclass

from agent.kube.client import ApiError, KubeApi
from agent.names import NEEDS_PREFLIGHT_LABEL, PREFLIGHT_LABEL
from agent.preflight.burnin import load_nvml
from agent.preflight.cuda import load_cuda
from agent.preflight.gates import Lazy, build_gates, run_gates
from agent.preflight.onboarding import (
    DEFAULT_EVENT_NAMESPACE,
    cordon_for_preflight,
    cordoned_by_preflight,
    onboard,
    record_on_node,
)
from agent.preflight.profile import Profile, ProfileError
from agent.preflight.result import FAIL, GATES, PASS, SKIP, GateFn, GateResult, passed
from agent.report.events import EventReporter
from agent.settings import ConfigError, add_program_flags, load_json, own_label_key, read_text_file, setting, to_bool

STEPS = ("all", "cordon", "gates", "record")
SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
RESULTS_LIMIT = 4 << 20  # bytes


class UsageError(Exception):
    pass


def render(results: list[GateResult], ok: bool) -> str:
    lines = [f"{'GATE':<8} {'STATUS':<8} {'TIME':>8}  REASON"]
    for r in results:
        lines.append(f"{r.gate:<8} {r.status:<8} {r.duration_s:>7.2f}s  {r.reason}")
    lines.append(f"preflight {'PASSED' if ok else 'FAILED'}")
    return "\n".join(lines)


# What each gate checks, for --help (docs/preflight.md has the whole table).
GATE_HELP = {
    "spec": "the node matches the profile: GPU model and count, memory per GPU, driver and CUDA versions, MIG "
    "mode, NVLink links, PCIe generation and width, ECC",
    "burnin": "sustained load on every GPU for burnInSeconds with correct results (built-in with cupy, or "
    "burnInCommand), failing on an Xid, new ECC errors or retired pages, or hardware throttling",
    "nvlink": "peer-to-peer copy bandwidth between every GPU pair is at least p2pMinGBps",
    "cuda": "a small kernel compiles (NVRTC) and computes the right result on every GPU",
    "serving": "serving.command exits 0 within maxLatencySeconds and its output matches expectOutput",
}
assert tuple(GATE_HELP) == GATES
DESCRIPTION = (
    "Run the five onboarding gates before a new or repaired GPU node takes work, and with --node record the "
    "outcome on the Node: all pass, label <label-key>=passed and uncordon it if preflight cordoned it; a gate "
    "fails, label <label-key>=failed, keep it cordoned and emit an Event naming the gate."
)


def gates_epilog(width: int = 79) -> str:
    """The gates, one per entry with a hanging indent, and the exit status (the parser shows it as written)."""
    lines = textwrap.wrap("gates, in this order (--gates runs some of them; each ends pass, fail or skipped):", width)
    for gate, text in GATE_HELP.items():
        lines += textwrap.wrap(
            text, width, initial_indent=f"  {gate:<9}", subsequent_indent=" " * 11, break_on_hyphens=False
        )
    lines += ["", *textwrap.wrap("exit status: 0 passed, 1 a gate failed, 2 a usage, profile or API error.", width)]
    return "\n".join(lines)


@dataclass(frozen=True)
class PreflightSettings:
    """`gpu-ready preflight`'s flags (docs/preflight.md): add_arguments derives them; _check_usage judges them."""

    profile: str | None = setting(str, None, "profile YAML (docs/preflight.md)", required=True)
    node: str | None = setting(str, None, "record the outcome on this Node (label, annotations, cordon, Event)")
    step: str = setting(
        str,
        "all",
        "all (default); or one step of the chart's Job: cordon (token), gates (no token; writes --results), "
        "record (token; reads --results)",
        choices=STEPS,
    )
    results: str | None = setting(
        str, None, "the gates step's results file (written by --step gates, read by --step record)"
    )
    nvidia_smi: str = setting(str, "nvidia-smi", "the nvidia-smi to run")
    kmsg: str = setting(str, "/dev/kmsg", "kernel log watched for Xids during burn-in")
    label_key: str = setting(str, PREFLIGHT_LABEL, "the label preflight writes: <key>=passed|failed")
    needs_label: str = setting(str, NEEDS_PREFLIGHT_LABEL, "label removed from the Node when preflight passes")
    event_namespace: str = setting(
        str,
        DEFAULT_EVENT_NAMESPACE,
        "namespace of the PreflightFailed Event (default: $GPU_READY_EVENT_NAMESPACE or default)",
        env="GPU_READY_EVENT_NAMESPACE",
    )
    gates: str = setting(str, ",".join(GATES), f"comma list of gates to run (default: {','.join(GATES)})")
    kubeconfig: str | None = setting(str, None, "a kubeconfig file (default: in-cluster, then ~/.kube/config)")
    json: bool = setting(to_bool, False, "print one JSON report")
    # tests point it elsewhere
    sa_token_path: str = setting(
        str, SA_TOKEN, "the ServiceAccount token the gates step refuses to run with", public=False
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description, p.epilog = textwrap.fill(DESCRIPTION, 79, break_on_hyphens=False), gates_epilog()
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # both are laid out already
    add_program_flags(p, PreflightSettings)


def _check_usage(args: argparse.Namespace) -> list[str]:
    if args.step in ("cordon", "record") and not args.node:
        raise UsageError(f"--step {args.step} needs --node")
    if args.step in ("gates", "record") and not args.results:
        raise UsageError(f"--step {args.step} needs --results")
    for flag, value in (("--label-key", args.label_key), ("--needs-label", args.needs_label)):
        try:  # the admission policy lets preflight's token change these two labels: never Kubernetes' own
            own_label_key(value)
        except ValueError as e:
            raise UsageError(f"{flag}: {e}") from None
    wanted = [g.strip() for g in args.gates.split(",") if g.strip()]
    bad = [g for g in wanted if g not in GATES]
    if bad:
        raise UsageError(f"unknown gates {bad}; gates are {', '.join(GATES)}")
    return wanted


def write_results(path: str, results: list[GateResult], ok: bool) -> None:
    """Atomically (a unique temp file renamed over the target), so the record step never reads half a file."""
    data = json.dumps({"passed": ok, "gates": [asdict(r) for r in results]}, default=str)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".results-", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_results(path: str) -> list[GateResult]:
    """The gates step's results; a missing or malformed file is one failed result saying so (never a pass)."""
    try:  # a regular file (a FIFO is refused, never waited on), nested at most settings.MAX_NESTING levels
        data = load_json(read_text_file(path, RESULTS_LIMIT))
        gates = data.get("gates") if isinstance(data, dict) else None
        if not isinstance(gates, list) or not gates:
            raise ValueError("no gate results in it")
        return [GateResult.from_mapping(g) for g in gates]
    except (OSError, ValueError, TypeError, OverflowError) as e:  # TypeError, OverflowError: float() of a field
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return [GateResult("gates", FAIL, f"no usable results from the gates step in {path}: {why}"[:500])]


def main(args: argparse.Namespace) -> int:
    try:
        wanted = _check_usage(args)
        profile = Profile.load(args.profile)
    except (UsageError, ProfileError) as e:
        print(f"gpu-ready preflight: {e}", file=sys.stderr)
        return 2
    try:
        return _run_step(args, profile, wanted)
    except ApiError as e:
        print(f"gpu-ready preflight: cannot update Node {args.node}: {e}", file=sys.stderr)
        return 2
    except (UsageError, ConfigError) as e:  # ConfigError: no usable kubeconfig or in-cluster credentials
        print(f"gpu-ready preflight: {e}", file=sys.stderr)
        return 2


def _api(args: argparse.Namespace) -> KubeApi:
    """The Node credentials from --kubeconfig or the in-cluster config, loaded as `run` loads them
    (kube.client.connect): a missing or broken kubeconfig is one ConfigError line, never a traceback."""
    from agent import config as config_mod
    from agent.kube.client import connect

    cfg = config_mod.defaults(kubeconfig=args.kubeconfig)
    return connect(cfg.kubeconfig, cfg.api_timeout)


def progress(line: str) -> None:
    """A progress line on stderr (stdout keeps the report, --json's one object included), written at once: the
    Job's log shows each gate start and end, and the burn-in's elapsed time, while preflight runs."""
    print(f"preflight: {line}", file=sys.stderr, flush=True)


GATE_EVENT_REASON = {PASS: "PreflightGatePassed", FAIL: "PreflightGateFailed", SKIP: "PreflightGateSkipped"}


def gate_events(api: KubeApi, node: str, results: list[GateResult], namespace: str) -> None:
    """One Event on the Node per gate result (kubectl describe node shows each gate of the run)."""
    uid = (api.get_node(node).get("metadata") or {}).get("uid")
    ev = EventReporter(api, node, interval_s=0, namespace=namespace, node_uid=uid)
    for r in results:
        note = f"preflight gate {r.gate} {r.status} in {r.duration_s:.1f}s: {r.reason}".strip().rstrip(":")
        ev.record(GATE_EVENT_REASON.get(r.status, "PreflightGateFailed"), note, gpu=r.gate,
                  type_="Warning" if r.status == FAIL else "Normal", action="Preflight")  # fmt: skip
    ev.flush()


def _run_step(args: argparse.Namespace, profile: Profile, wanted: list[str]) -> int:
    def gates() -> dict[str, GateFn]:
        built = build_gates(profile, args.nvidia_smi, Lazy(load_cuda), Lazy(load_nvml), args.kmsg, progress=progress)
        return {k: v for k, v in built.items() if k in wanted}

    if args.step == "cordon":
        api = _api(args)
        by_us = cordon_for_preflight(api, args.node)
        print(f"node {args.node} cordoned{' by preflight' if by_us else ' (by someone else: stays cordoned)'}")
        return 0
    if args.step == "gates":
        if os.path.exists(args.sa_token_path):
            raise UsageError(
                f"refusing to run the gates with a ServiceAccount token at {args.sa_token_path}: the burn-in and "
                "serving commands must not get the Node credentials (mount the token only into cordon/record)"
            )
        results = run_gates(gates(), profile.timeouts, progress)
        ok, _ = passed(results, profile.allow_skip)
        try:
            write_results(args.results, results, ok)
        except OSError as e:
            raise UsageError(f"cannot write --results {args.results}: {e.strerror or e}") from None
        _print(args, results, ok)
        return 0  # the results are written; the record step judges them
    if args.step == "record":
        results = read_results(args.results)
        ok, blocking = passed(results, profile.allow_skip)
        api = _api(args)
        by_us = cordoned_by_preflight(api.get_node(args.node))
        record_on_node(
            api, args.node, results, ok, blocking, args.label_key, args.needs_label, by_us, args.event_namespace
        )
        gate_events(api, args.node, results, args.event_namespace)
        _print(args, results, ok)
        return 0 if ok else 1
    if args.node:
        api = _api(args)
        ok, results = onboard(
            api,
            args.node,
            gates(),
            profile,
            args.label_key,
            args.needs_label,
            args.event_namespace,
            progress,
        )
        gate_events(api, args.node, results, args.event_namespace)
    else:
        results = run_gates(gates(), profile.timeouts, progress)
        ok, _ = passed(results, profile.allow_skip)
    _print(args, results, ok)
    return 0 if ok else 1


def _print(args: argparse.Namespace, results: list[GateResult], ok: bool) -> None:
    if args.json:
        print(json.dumps({"passed": ok, "gates": [asdict(r) for r in results]}, indent=2, default=str))
    else:
        print(render(results, ok))
