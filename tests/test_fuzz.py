"""Fuzz suite: every parser and `gpu-ready check` on arbitrary input. Each property asserts that
no exception escapes, that nothing reads healthy when its check could not run, and a time bound per input.

The budget is fixed (max_examples per test, no shrinking database), so the whole file costs well under a
minute on two busy cores; `HYPOTHESIS_PROFILE=fuzz-long` runs ten times more examples.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import config
from agent.cli import build_parser
from agent.cli import main as cli_main
from agent.kernel_log.link import MAX_LINE as LINK_LINE
from agent.kernel_log.link import parse_link_change
from agent.kernel_log.source import MAX_RECORD, KmsgSource, KmsgUnavailable, format_record, parse_record
from agent.kernel_log.xid import MAX_LINE as XID_LINE
from agent.kernel_log.xid import KernelLogParser
from agent.model import PciAddress, Severity
from agent.preflight import FAIL, Profile, ProfileError, read_results
from agent.probes.base import ProbeContext
from agent.probes.device_plugin import plugin_counts, plugin_findings
from agent.probes.fabric import MAX_GPUS as FABRIC_MAX_GPUS
from agent.probes.fabric import fabric_findings, parse_smi_q
from agent.probes.infiniband import InfinibandProbe
from agent.probes.nvidia_smi import MAX_LINE as SMI_LINE
from agent.probes.nvidia_smi import parse_smi_table, smi_findings
from agent.probes.sysfs import SysfsReader
from agent.settings import INT_LIMIT, in_range, to_float, to_int, to_int_list
from agent.state import read_boot_id
from testkit.fixture_files import FIXTURES
from testkit.harness import returns_within
from testkit.parse_counts import link_pattern_lines, smi_row_lines, xid_pattern_lines
from testkit.simhost import SimHost

settings.register_profile(
    "fuzz",
    deadline=None,  # time is bounded by explicit asserts with a margin for a loaded machine instead
    database=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
settings.register_profile("fuzz-long", parent=settings.get_profile("fuzz"), max_examples=2000)
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "fuzz"))


def budget(n: int) -> settings:
    return settings(PROFILE, max_examples=n if PROFILE.max_examples == 100 else PROFILE.max_examples)


# -- building blocks: real lines from every captured sample, mutated, plus pathological shapes ----------------------

SMI_LINES = sorted(
    {
        line
        for p in FIXTURES.glob("smi-*.txt")
        for line in p.read_text(encoding="utf-8", errors="replace").splitlines()[:400]
        if line.strip()
    }
)
KMSG_LINES = sorted(
    {
        line
        for p in [*FIXTURES.glob("xid-*.txt"), *FIXTURES.glob("nvrm-*.txt"), *FIXTURES.glob("kmsg-*.txt")]
        for line in p.read_text(encoding="utf-8", errors="replace").splitlines()[:400]
        if line.strip()
    }
)
TOKENS = ["|", " ", "ERR!", "N/A", ":", ".", "0", "9" * 30, "\t", "\x00", "\u2502", "MIG devices:", "Processes:", "+--"]


@st.composite
def mutated(draw: st.DrawFn, lines: list[str]) -> str:
    line = draw(st.sampled_from(lines))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(line)))
        op = draw(st.sampled_from(["insert", "delete", "repeat"]))
        if op == "insert":
            line = line[:at] + draw(st.sampled_from(TOKENS) | st.text(max_size=8)) + line[at:]
        elif op == "delete":
            line = line[:at] + line[at + draw(st.integers(0, 10)) :]
        else:
            line = line[:at] + line[at : at + 3] * draw(st.integers(1, 3000)) + line[at:]
    return line


PATHOLOGICAL = st.sampled_from(
    [
        "|   0 " + " " * 200_000 + "x|",
        "|" * 100_000,
        "| 0 " + "ERR! " * 50_000 + "|",
        "Unable to determine the device handle for GPU" + "0" * 100_000,
        "Unable to determine the device handle for GPU" + "1: " * 30_000,
        "Driver Version: " + " " * 100_000,
        "|  0    1   0   0  |" + " 0 " * 40_000,
        "NVRM: Xid (" + "0" * 100_000,
        "mlx5_core " + "0000:1b:00.0 " * 20_000 + "bootnet: Link down",
        "mlx5_core 0000:1b:00.0: " + "Port module event: module 1, " * 5_000 + "Cable unplugged",
        "NVRM: Xid (PCI:0000:3b:00): " + "9" * 5_000 + ", pid=1",
        "NVRM: Xid (PCI:0000:3b:00" + " " * 100_000,
        "nvidia-nvswitch0: SXid (PCI:" + "0:" * 50_000,
        "NVRM: GPU " + "0" * 100_000,
    ]
)

smi_text = st.lists(
    mutated(SMI_LINES) | st.sampled_from(SMI_LINES) | st.text(max_size=200) | PATHOLOGICAL, max_size=60
).map("\n".join)
kmsg_text = mutated(KMSG_LINES) | st.sampled_from(KMSG_LINES) | st.text(max_size=300) | PATHOLOGICAL

json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=20,
)
quantity = st.sampled_from(["0", "1", "8", "80", "1k", "2Ki", "-1", "8.5", "", "abc", "9" * 40]) | json_value
resources = st.dictionaries(
    st.sampled_from(["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb", "cpu", "memory"]),
    quantity,
    max_size=4,
)
labels = st.dictionaries(
    st.sampled_from(["nvidia.com/mig.strategy", "nvidia.com/gpu.replicas", "nvidia.com/gpu.present", "x"]),
    st.sampled_from(["none", "single", "mixed", "4", "0", "many", ""]) | json_value,
    max_size=3,
)
node_like = st.fixed_dictionaries(
    {},
    optional={
        "kind": st.sampled_from(["Node", "Pod"]) | json_value,
        "metadata": st.fixed_dictionaries({}, optional={"labels": labels | json_value}) | json_value,
        "status": st.fixed_dictionaries({}, optional={"capacity": resources, "allocatable": resources}) | json_value,
    },
)
any_node = node_like | json_value


# -- nvidia-smi table ------------------------------------------------------------------------------------------------


@budget(150)
@given(smi_text, st.integers(-300, 300))
def test_smi_parser(text: str, rc: int) -> None:
    with smi_row_lines() as seen:
        table = parse_smi_table(text)
    assert all(n <= SMI_LINE for n in seen)  # linear: every line cut before the row patterns
    findings = smi_findings(table, rc, text)
    addresses = {g.address for g in table.gpus}
    for f in findings:
        assert f.gpu is None or isinstance(f.gpu, PciAddress)
        if f.kind == "err_field" and f.gpu is not None:
            assert f.gpu in addresses
    if not table.gpus:  # no GPU table: never an all-clear
        assert findings and all(f.severity is not Severity.INFO for f in findings)
    if rc != 0:
        assert any(f.severity is Severity.FAULT for f in findings)


# -- nvidia-smi -q: the Fabric blocks ------------------------------------------------------------------------------


@budget(150)
@given(smi_text)
def test_smi_q_fabric_parser(text: str) -> None:
    infos = parse_smi_q(text)
    assert len(infos) <= FABRIC_MAX_GPUS
    for addr, info in infos.items():
        assert info.gpu == addr and len(info.state) <= 200 and len(info.status) <= 200
    for f in fabric_findings(infos.values()):  # every finding names one of the GPUs read
        assert f.gpu in infos and f.severity is Severity.FAULT


# -- kernel log: record parser, file reader, Xid parser ----------------------------------------------------------


@budget(150)
@given(kmsg_text, st.integers(0, 2**64), st.integers(0, 23), st.integers(0, 7))
def test_kmsg_record_parser(text: str, seq: int, facility: int, level: int) -> None:
    raw = text if text.count(";") % 2 else format_record(text.replace("\n", " "), seq, 0, facility, level)
    rec = parse_record(raw)
    if rec is not None:
        assert len(rec.text) <= MAX_RECORD and "\n" not in rec.text


@budget(60)
@given(st.lists(kmsg_text | st.binary(max_size=300).map(lambda b: b.decode("latin-1")), max_size=20))
def test_kmsg_file_reader(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kmsg"
        data = "\n".join(lines)
        path.write_bytes(data.encode("utf-8", "surrogateescape"))
        src = KmsgSource(str(path))
        try:
            out = [r for batch in src.drain() for r in batch]
        finally:
            src.close()
    assert len(out) <= data.count("\n") + 1 and all(len(r.text) <= MAX_RECORD for r in out)
    assert len(src._buf) <= MAX_RECORD


@budget(150)
@given(st.lists(kmsg_text, max_size=12))
def test_kernel_log_parser(lines: list[str]) -> None:
    parser = KernelLogParser()
    for line in lines:
        with xid_pattern_lines() as seen:
            events = parser.feed(line[:MAX_RECORD])
        assert all(n <= XID_LINE for n in seen)  # linear: lines cut before the patterns
        for ev in events:
            assert isinstance(ev.fatal, bool) and isinstance(ev.xid, int)
            assert ev.address is None or isinstance(ev.address, PciAddress)
        with link_pattern_lines() as seen:
            change = parse_link_change(line[:MAX_RECORD])
        assert all(n <= LINK_LINE for n in seen)  # linear: lines cut before the link-change patterns too
        if change is not None:
            assert "mlx5_core" in change.text and len(change.text) <= LINK_LINE and change.state
            assert PciAddress.parse(change.address) is not None


@budget(300)
@given(st.text(max_size=60) | st.sampled_from(["0000:3b:00", "PCI:0000:3B:00.0", "00000000:3b:00.7", "3b:00"]))
def test_pci_address(text: str) -> None:
    a = PciAddress.parse(text)
    if a is not None:
        assert PciAddress.parse(a.nvml) == a == PciAddress.parse(a.kernel)


# -- device-plugin counting over any JSON --------------------------------------------------------------------------


@budget(300)
@given(any_node, st.sampled_from(["auto", "none", "single", "mixed"]), st.none() | st.integers(1, 64))
def test_plugin_counting(node: Any, strategy: str, replicas: int | None) -> None:
    pc = plugin_counts(node, None, strategy, replicas)
    findings = plugin_findings(pc, True, 0)
    if pc.malformed is not None:
        assert [f.severity for f in findings] == [Severity.UNCHECKED]
    else:
        assert isinstance(node, dict)
        assert all(isinstance(v, int) and v >= 0 for v in [*pc.capacity.values(), *pc.allocatable.values()])
        assert pc.physical is None or (isinstance(pc.physical, int) and pc.physical >= 0)
        if not pc.capacity:  # nothing advertised: never reads as a serving plugin
            assert findings and findings[0].severity is Severity.FAULT


# -- configuration ------------------------------------------------------------------------------------------------


@budget(200)
@given(st.sampled_from(config.SETTINGS), st.text(max_size=40) | st.sampled_from(["nan", "inf", "-1", "1e999", "0"]))
def test_config_environment_values(setting: config.Setting, value: str) -> None:
    try:
        cfg = config.load(None, environ={setting.env_name: value})
    except config.ConfigError as e:
        assert str(e) and "\n" not in str(e).strip()
        return
    v = getattr(cfg, setting.name)
    if isinstance(v, float):
        assert v == v and v not in (float("inf"), float("-inf")), f"{setting.name} accepted {value!r}"


@budget(60)
@given(json_value | st.text(max_size=200))
def test_config_file_contents(doc: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.yaml"
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        with contextlib.suppress(config.ConfigError):
            config.load(None, environ={"GPU_READY_CONFIG": str(path)})


# -- the CLI: `gpu-ready check` with any Node JSON and any nvidia-smi output -------------------------------------


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> SimHost:
    h = SimHost(tmp_path_factory.mktemp("fuzzhost") / "host")
    # A stand-in that costs a shell start, not a Python start: it prints `out` and exits with `rc`.
    # Each run leaves one line in `runs`, so a test counts them.
    h.nvidia_smi.write_text(
        f'#!/bin/sh\necho "$*" >> "{h.root}/runs"\ncat "{h.root}/out"\nexit "$(cat "{h.root}/rc")"\n'
    )
    return h


@budget(30)
@given(
    node=any_node | st.text(max_size=50),
    smi=smi_text | st.sampled_from([p.name for p in FIXTURES.glob("smi-table-*.txt")]),
    rc=st.sampled_from([0, 0, 0, 1, 6, 9, 14, 15, 255]),
)
def test_check_cli(host: SimHost, node: Any, smi: str, rc: int) -> None:
    if smi.startswith("smi-table-") and smi.endswith(".txt"):
        smi = (FIXTURES / smi).read_text()
    (host.root / "out").write_text(smi, encoding="utf-8", errors="surrogateescape")
    (host.root / "rc").write_text(str(rc))
    node_path = host.root / "node.json"
    node_path.write_text(node if isinstance(node, str) else json.dumps(node))
    out, err = io.StringIO(), io.StringIO()
    (host.root / "runs").write_text("")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["check", *host.check_args(), "--json", "--node-json", str(node_path)])
    runs = (host.root / "runs").read_text().splitlines()
    # One table run at most (none when the Node JSON is refused) and at most one `-q` for the NVLink fabric (NVML is
    # off here; only after a table that listed GPUs): no retry loop.
    assert runs.count("") <= 1 and runs.count("-q") <= 1 and set(runs) <= {"", "-q"}, runs
    if "-q" in runs:
        assert runs.index("-q") == 1 and parse_smi_table(smi).gpus, runs
    assert code in (0, 1, 2, 3) and "Traceback" not in out.getvalue() + err.getvalue()
    if not out.getvalue().strip():  # refused as bad input: one line, exit 2
        assert code == 2 and len(err.getvalue().strip().splitlines()) == 1
        return
    verdict = json.loads(out.getvalue())
    assert {"True": 0, "False": 1, "Unknown": 3}[verdict["status"]] == code
    if verdict["status"] == "True":  # only when every check could run and saw GPUs
        assert plugin_counts(json.loads(node_path.read_text()), None).malformed is None
        assert parse_smi_table(smi).gpus and rc == 0


# -- bad input: deep nesting, huge integers, endless sources, FIFOs; argparse errors ------------------------------

HUGE_LEAVES = st.sampled_from(
    ["1", "9" * 19, "9" * 400, "-" + "9" * 400, "9" * 5000, "1e999", "-1e400", '"x"', "[]", "{}"]
)


@st.composite
def deep_or_huge(draw: st.DrawFn) -> tuple[str, str]:
    """(file name, text): a settings file, a profile or a results file with a value nested 0 to 3000 levels deep
    (flow, block or JSON) and a leaf that is a huge integer, an overflowing float or an empty collection."""
    kind = draw(st.sampled_from(["config.yaml", "config.json", "profile.yaml", "results.json"]))
    depth = draw(st.integers(0, 3000) | st.integers(60, 70))
    leaf = draw(HUGE_LEAVES | st.integers(-(10**500), 10**500).map(str))
    key = draw(st.sampled_from(["pollInterval", "recoveryPolls", "xidFatal", "gpuCount", "timeouts", "serving", "x"]))
    if kind.endswith(".json"):
        value = "[" * depth + leaf + "]" * depth
        if kind == "results.json":
            return kind, '{"gates": [{"gate": "spec", "status": "pass", "duration_s": ' + value + "}]}"
        return kind, "{" + json.dumps(key) + ": " + value + "}"
    style = draw(st.sampled_from(["flow", "mapping", "block", "dashes"]))
    if style == "flow":
        value = "[" * depth + leaf + "]" * depth
    elif style == "mapping":
        value = "{a: " * depth + leaf + "}" * depth
    elif style == "dashes":
        value = "\n  " + "- " * depth + leaf
    else:
        depth = min(depth, 300)  # indentation grows quadratically: keep it under the size limit
        value = "\n" + "".join(" " * (i + 1) + "a:\n" for i in range(depth)) + " " * (depth + 1) + leaf
    return kind, f"{key}: {value}\n"


def finishes(fn: Any, timeout_s: float = 60.0) -> Any:
    """Runs fn on a thread; fails the test if it has not returned within timeout_s (a stall, not a slow run)."""
    return returns_within(fn, timeout_s)


@budget(80)
@given(deep_or_huge())
def test_deep_nesting_and_huge_integers_are_one_line(case: tuple[str, str]) -> None:
    name, text = case
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_text(text)
        if name == "results.json":  # never raises: a failed result saying why, or the results
            got = read_results(str(path))
            assert got and (got[0].status != FAIL or "\n" not in got[0].reason)
            return
        try:
            if name.startswith("profile"):
                Profile.load(str(path))
            else:
                config.load(None, environ={"GPU_READY_CONFIG": str(path)})
        except (config.ConfigError, ProfileError) as e:
            assert str(e) and "\n" not in str(e) and len(str(e)) < 1000


@budget(200)
@given(
    st.integers()
    | st.integers(-(10**4000), 10**4000)
    | st.sampled_from([INT_LIMIT, -INT_LIMIT, INT_LIMIT - 1, 10**400, float(10**300), 1e18, "1e300", "9" * 400])
)
def test_converters_never_return_huge_numbers(value: Any) -> None:
    for conv in (to_int, to_float, in_range(to_int, 0, 100), in_range(to_float, -1, 1), to_int_list):
        try:
            out = conv(value)
        except ValueError as e:
            assert "\n" not in str(e) and len(str(e)) < 200
            continue
        for x in out if isinstance(out, tuple) else (out,):
            assert -INT_LIMIT <= x <= INT_LIMIT  # 999_999_999_999_999_936 as a float is 1e18


SPECIAL_FILES = ["/dev/zero", "/dev/urandom", "/dev/null", "/dev/full", "fifo", "dir", "socket"]


@budget(40)
@given(st.sampled_from(SPECIAL_FILES), st.sampled_from(["config", "profile", "results", "kmsg", "boot_id"]))
def test_endless_and_special_files_are_refused_without_waiting(kind: str, reader: str) -> None:
    """A FIFO nobody writes, /dev/zero that never ends, a directory, a socket: refused (could not check), never
    read until it ends and never waited on."""
    with tempfile.TemporaryDirectory() as d:
        path = {"fifo": f"{d}/fifo", "dir": d, "socket": f"{d}/sock"}.get(kind, kind)
        if kind == "fifo":
            os.mkfifo(path)
        listener = None
        if kind == "socket":
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(path)
        try:
            if reader == "kmsg":
                src = KmsgSource(path)
                try:
                    with pytest.raises(KmsgUnavailable):
                        finishes(lambda: [r for batch in src.drain() for r in batch])
                finally:
                    src.close()
            elif reader == "boot_id":
                assert finishes(lambda: read_boot_id(path)) == "unknown"
            elif reader == "results":
                got = finishes(lambda: read_results(path))
                assert [r.status for r in got] == [FAIL]
            else:
                load = Profile.load if reader == "profile" else (lambda p: config.load(None, {"GPU_READY_CONFIG": p}))
                with pytest.raises((config.ConfigError, ProfileError)) as ei:
                    finishes(lambda: load(path))
                assert "\n" not in str(ei.value)
        finally:
            if listener is not None:
                listener.close()


RAIL_FILES = ["counters/link_downed", "counters/port_rcv_errors", "state", "phys_state", "rate", "link_layer"]


@budget(30)
@given(st.sampled_from(SPECIAL_FILES), st.sampled_from(RAIL_FILES))
def test_special_files_at_a_rail_file_finish_and_are_never_a_healthy_rail(kind: str, name: str) -> None:
    """Whatever sits where an InfiniBand attribute should be (a FIFO nobody writes, an endless device, a directory,
    a socket), the rails probe returns within its deadline, holds at most its bound of blocked threads, and a file it
    could not read is never a healthy rail."""
    with tempfile.TemporaryDirectory() as d:
        host = SimHost(Path(d) / "h", gpus=1, extra_functions=False)
        host.set_ib_port("mlx5_0")
        target = host.ib_port_file("mlx5_0", name)
        target.unlink()
        listener = None
        if kind == "fifo":
            host.wedge(target)
        elif kind == "dir":
            target.mkdir()
        elif kind == "socket":
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(str(target))
        else:
            target.symlink_to(kind)
        reader = SysfsReader(0.05, max_blocked=2)
        try:
            r = finishes(lambda: InfinibandProbe(str(host.sysfs), reader=reader).read(ProbeContext()), 30)
            assert reader.blocked <= 2
            if kind == "fifo" or name in ("state", "phys_state"):
                assert not r.ran  # could not check
            else:  # a rate, layer or counter that is not one: judged without it, never a rail that reads up
                assert r.ran or r.findings[0].severity is Severity.UNCHECKED
        finally:
            host.unwedge(content="0\n")
            if listener is not None:
                listener.close()


ARGV_WORDS = ["check", "gpus", "run", "preflight", "bogus", "--bogus", "--kmsg", "--node", "--node-json", "--json"]
ARGV_WORDS += ["--step", "all", "record", "nope", "--profile", "p.yaml", "--poll-interval", "5", "--config", "x"]
ARGV_WORDS += ["--pcie", "--no-pcie", "--pcie=false", "--no-pcie=true", "true", "maybe", "--node-name", "n"]


@budget(200)
@given(st.lists(st.sampled_from(ARGV_WORDS) | st.text(max_size=6), max_size=8))
def test_usage_errors_are_one_line(argv: list[str]) -> None:
    parser = build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            _args, extra = parser.parse_known_args(argv)
        except SystemExit as e:
            assert e.code == 2
            text = err.getvalue()
            assert len(text.strip().splitlines()) == 1 and text.startswith("gpu-ready") and ": error: " in text
            return
    assert isinstance(extra, list)
