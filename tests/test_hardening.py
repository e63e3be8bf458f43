"""Defects found in the device-plugin count, the nvidia-smi parser and runner, the kernel-log reader, the HTTP
server and the --node-json reader, each reproduced, then held fixed: mig.strategy=single with MIG disabled, ERR!
in the MIG devices section and duplicated bus ids, both shapes of nvidia-smi's handle error, linear-time parsing
and bounded lines, nvidia-smi's output cap and process tree, a bounded HTTP server, any --node-json shape, and a
sysfs file that never answers.

Real processes everywhere (nvidia-smi stand-ins, the real HTTP server, the real CLI); only the GPU is faked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.request
from pathlib import Path

import pytest

from agent.cli import main as cli_main
from agent.http import HealthServer
from agent.kernel_log.source import MAX_RECORD, KmsgSource, format_record, parse_record
from agent.model import PciAddress, Reason, Severity
from agent.probes.device_plugin import MigCounts, parse_count, plugin_counts, plugin_findings
from agent.probes.nvidia_smi import MAX_LINE, NvidiaSmiRunner, parse_smi_table, probe_nvidia_smi, smi_findings
from agent.report.metrics import Metrics
from testkit.daemons import daemons, stand_in
from testkit.fixture_files import fixture_path
from testkit.harness import wait_for
from testkit.parse_counts import smi_row_lines, xid_pattern_lines
from testkit.simhost import SimHost

SINGLE = {"nvidia.com/mig.strategy": "single"}


def run_check(simhost: SimHost, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict, str]:
    rc = cli_main(["check", *simhost.check_args(), "--json", *extra])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if out.strip().startswith("{") else {}), err


def node_json(tmp_path: Path, doc: object) -> str:
    path = tmp_path / "node.json"
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(path)


def gpu_node(count: str, labels: dict[str, str] | None = None) -> dict:
    res = {"cpu": "8", "nvidia.com/gpu": count}
    return {"kind": "Node", "metadata": {"labels": labels or {}}, "status": {"capacity": res, "allocatable": res}}


# -- mig.strategy=single on GPUs with MIG disabled still counts the plugin -----------------------------------------


def test_single_strategy_with_mig_disabled_counts_whole_gpus():
    disabled = MigCounts(mig_enabled_gpus=0, gpus_with_mig_devices=0, mig_devices=0, full_gpus=8)
    pc = plugin_counts(gpu_node("1", SINGLE), disabled)
    assert (pc.strategy, pc.physical) == ("single", 1), "before the fix: physical None, the count was skipped"
    assert plugin_counts(gpu_node("8", SINGLE), disabled).physical == 8
    # MIG on with devices: the per-GPU division still applies; layout unknown still says so
    on = MigCounts(mig_enabled_gpus=8, gpus_with_mig_devices=8, mig_devices=56)
    assert plugin_counts(gpu_node("56", SINGLE), on).physical == 8
    assert plugin_counts(gpu_node("8", SINGLE), None).physical is None


def test_check_node_json_single_strategy_plugin_serving_one_of_eight_is_false(simhost, tmp_path, capsys):
    rc, v, _ = run_check(simhost, capsys, "--node-json", node_json(tmp_path, gpu_node("1", SINGLE)))
    assert (rc, v["status"], v["reason"]) == (1, "False", "GPUCountMismatch"), v
    assert v["counts"]["plugin_physical"] == 1
    rc, v, _ = run_check(simhost, capsys, "--node-json", node_json(tmp_path, gpu_node("8", SINGLE)))
    assert (rc, v["status"]) == (0, "True"), v


@pytest.mark.apiserver
def test_run_single_strategy_plugin_serving_one_of_eight_is_false(agent_factory, make_node, simhost, admin):
    node = make_node(
        labels={"nvidia.com/gpu.present": "true", **SINGLE},
        capacity={"nvidia.com/gpu": "1"},
        allocatable={"nvidia.com/gpu": "1"},
    )
    agent = agent_factory(node=node)
    c = agent.wait_status(admin, "False", "GPUCountMismatch", timeout=60)
    assert "device plugin serves 1" in c["message"]


# -- ERR! in the MIG devices section, duplicated bus ids -----------------------------------------------------------

MIG_H200 = "smi-table-MIG-h200-590.48.01-load-nvgpuexp-capture.txt"


SEP = "+------------------+----------------------------------+-----------+-----------------------+\n"
BAR1 = "|                  |               0MiB / 14809MiB    |           |                       |\n"


ROW2 = "|  0    3   0   2  |              17MiB / 33280MiB  "
NEXT = BAR1 + SEP + "|  0   10"


@pytest.mark.parametrize(
    ("old", "new", "device"),
    [
        # the device row itself (its memory usage), and the continuation line (BAR1 usage) of another device
        (ROW2, ROW2.replace("17MiB / 33280MiB", "ERR!            "), "MIG device 2 (GI 3, CI 0)"),
        (NEXT, NEXT.replace("0MiB / 14809MiB", "ERR!           "), "MIG device 3 (GI 9, CI 0)"),
    ],
)
def test_err_in_mig_devices_section_is_a_finding_naming_the_gpu(old, new, device):
    text = fixture_path(MIG_H200).read_text()
    assert smi_findings(parse_smi_table(text), 0, text) == [], "the capture itself is healthy"
    assert text.count(old) == 1
    bad = text.replace(old, new)
    f = smi_findings(parse_smi_table(bad), 0, bad)
    assert [(x.reason, x.gpu, x.kind) for x in f] == [
        (Reason.NVIDIA_SMI_ERR, PciAddress.parse("00000000:83:00.0"), "err_field")
    ], "before the fix: ERR! under 'MIG devices:' was ignored"
    assert device in f[0].message


def test_err_in_mig_section_without_an_owner_still_counts():
    text = fixture_path(MIG_H200).read_text().replace("|  0    2   0   0  |", "| ERR!  2   0   0  |")
    f = smi_findings(parse_smi_table(text), 0, text)
    assert any(x.reason is Reason.NVIDIA_SMI_ERR and "MIG devices" in x.message for x in f), f


def test_duplicated_bus_id_is_a_finding(simhost, capsys):
    text = fixture_path("smi-table-healthy-h100x8-550.90.07-gpud-fixture.txt").read_text()
    dup = text.replace("00000000:4C:00.0", "00000000:19:00.0")
    t = parse_smi_table(dup)
    assert len(t.gpus) == 8 and len({g.address for g in t.gpus}) == 7
    f = smi_findings(t, 0, dup)
    assert [(x.kind, x.gpu.nvml if x.gpu else None) for x in f] == [("duplicate_bus_id", "00000000:19:00.0")]
    assert "GPU 0 and GPU 2" in f[0].message
    # end to end: the PCI GPU at 4C hides behind the duplicate (8 = 8 by count) and must not read True
    simhost.set_smi(output=dup)
    rc, v, _ = run_check(simhost, capsys)
    assert v["status"] == "False" and rc == 1, v


# -- both handle-error shapes mark the right GPU -------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "Unable to determine the device handle for GPU 0000:34:00.0: Unknown Error",
        "Unable to determine the device handle for GPU0000:34:00.0: Unknown Error",
        "Unable to determine the device handle for GPU1: 0000:34:00.0: Unknown Error",
        "Unable to determine the device handle for GPU12: 00000000:34:00.0: Unknown Error",
        "unable to determine the device handle for gpu1: 0000:34:00.0: Unknown Error",
        "UNABLE TO DETERMINE THE DEVICE HANDLE FOR GPU 0000:34:00.0: UNKNOWN ERROR",
        "Unable to determine the device handle for gpu 0000:34:00.0: GPU is lost",
    ],
)
def test_handle_error_shapes_mark_the_gpu(line):
    t = parse_smi_table(line + "\n")
    f = smi_findings(t, 15, line)
    handle = [x for x in f if x.kind == "device_handle"]
    assert len(handle) == 1 and handle[0].gpu == PciAddress(0, 0x34, 0), "before the fix `GPU1:` read as address 1"
    assert "0000:34:00.0" in handle[0].message and handle[0].reason is Reason.NVIDIA_SMI_FAILED


def test_handle_error_of_newer_driver_names_the_gpu_end_to_end(tmp_path, capsys):
    """The 610 capture: GPU 1 at 0000:34:00.0 cannot be reached, GPUs 0, 2, 3 are listed."""
    host = SimHost(tmp_path / "host", buses=(0x16, 0x34, 0xAC, 0xCA), name="NVIDIA RTX PRO 6000")
    host.set_smi(fixture=fixture_path("smi-handle-gpuindex-table-rtxpro6000-610.57.04-dfch-llmops.txt"))
    rc, v, _ = run_check(host, capsys)
    assert (rc, v["status"], v["reason"]) == (1, "False", "NvidiaSmiFailed"), v
    bad = [g for g in v["gpus"] if g["healthy"] is False]
    assert [g["pci_bus_id"] for g in bad] == ["00000000:34:00.0"], v["gpus"]
    assert "0000:34:00.0" in v["message"]


# -- nvidia-smi and kmsg: linear-time parsing and bounded lines -----------------------------------------------------


@pytest.mark.parametrize("spaces", [16_000, 200_000, 4_000_000])
def test_smi_row_with_a_sea_of_spaces_is_cut_before_the_patterns(spaces):
    """The row that took 6 s at 16k spaces (and stalled at 200k) reaches the patterns at MAX_LINE characters (its
    time: bench/parsing.py)."""
    text = "|   0 " + " " * spaces + "x|\n"
    with smi_row_lines() as seen:
        t = parse_smi_table(text)
    assert seen and max(seen) <= MAX_LINE, seen
    assert t.gpus == [] and smi_findings(t, 0, text)[0].severity is Severity.UNCHECKED


def test_smi_parser_work_grows_linearly():
    """8x the lines: 8x the characters the row patterns see, never more (a quadratic parser's 64x)."""
    line = "|   0  NVIDIA H100 " + "  ERR! " * 20 + "| 00000000:19:00.0 Off |  0 |\n"
    with smi_row_lines() as small:
        parse_smi_table(line * 2_000)
    with smi_row_lines() as large:
        parse_smi_table(line * 16_000)
    assert (sum(large), len(large)) == (8 * sum(small), 8 * len(small))


def test_smi_lines_are_cut_to_max_line():
    row = "|   0  NVIDIA H100 80GB HBM3   On  |   00000000:19:00.0 Off |    0 |"
    t = parse_smi_table(row + " " * (MAX_LINE * 4) + "ERR!\n")
    assert len(t.gpus) == 1 and t.gpus[0].err_fields == []  # what lies past MAX_LINE is not read
    assert parse_smi_table("|" + "9" * 5000 + "  X | 00000000:19:00.0 Off | 0 |\n").gpus == []  # no 5000-digit index


def test_kmsg_record_of_100kb_is_cut_before_parsing(tmp_path):
    huge = "NVRM: Xid (PCI:0000:3b:00): 79, " + "A" * 100_000
    rec = parse_record(format_record(huge, 7))  # its time: bench/parsing.py
    assert rec is not None and len(rec.text) <= MAX_RECORD
    # a file with a 100 KB line and a 5 MB line without a newline: bounded buffer, records after it still read
    log = tmp_path / "kmsg"
    log.write_text(format_record(huge, 1) + format_record("after", 2) + "6,3,0,-;" + "B" * 5_000_000)
    src = KmsgSource(str(log))
    recs, _ = src.read_available()
    assert [len(r.text) <= MAX_RECORD for r in recs] == [True, True] and recs[1].text == "after"
    assert len(src._buf) <= MAX_RECORD
    src.close()


def test_check_kmsg_with_a_100kb_record_finishes(simhost, capsys):
    """The records that took `check` 20 s reach the Xid patterns cut to MAX_LINE characters, and the fatal Xid
    after them is still found."""
    from agent.kernel_log.xid import MAX_LINE as XID_LINE

    simhost.append_kmsg("NVRM: Xid (" + "0" * 100_000, "NVRM: Xid (PCI:0000:3b:00" + " " * 100_000)
    simhost.append_xid(79, gpu=1)
    with xid_pattern_lines() as seen:
        _, v, _ = run_check(simhost, capsys)
    assert seen and max(seen) <= XID_LINE, max(seen)
    assert (v["status"], v["reason"]) == ("False", "FatalXid"), v


def test_kmsg_link_change_records_of_100kb_are_cut_and_the_next_change_still_counts(tmp_path):
    """The InfiniBand/RoCE link-change patterns see huge records cut to MAX_LINE characters; the real record after
    them still wakes the runner, and nothing is latched."""
    from agent.kernel_log.link import MAX_LINE as LINK_LINE
    from agent.kernel_log.watcher import KernelLogIngest
    from agent.kernel_log.xid import KernelLogParser
    from agent.state import LatchState
    from testkit.parse_counts import link_pattern_lines

    log = tmp_path / "kmsg"
    log.write_text(
        format_record("mlx5_core 0000:1b:00.0 Link " + "x" * 100_000 + ": Link down", 1)
        + format_record("mlx5_core 0000:1b:00.0: Port module event: module " + "9" * 100_000, 2)
        + format_record("mlx5_core 0000:1b:00.1: Port module event: module 1, Cable unplugged", 3)
    )
    state = LatchState(str(tmp_path / "state"), "boot")
    ingest = KernelLogIngest(KernelLogParser(), state, Metrics(), links=True)
    src = KmsgSource(str(log))
    with link_pattern_lines() as seen:
        recs, _ = src.read_available()
        assert ingest.process(recs) == []
    src.close()
    assert len(seen) == 3 and max(seen) <= LINK_LINE, seen
    assert ingest.link_change_count == 1 and ingest.link_changes[0].subject == "0000:1b:00.1 module 1"
    assert state.snapshot() == []


# -- nvidia-smi runner: output cap, process group, no leaked setsid() grandchildren ---------------------------------


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False


def pids_in(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_output_is_read_up_to_the_cap_with_memory_bounded(tmp_path):
    smi = stand_in(
        tmp_path,
        """
        import sys
        block = b"x" * (1 << 20)
        for _ in range(300):  # 300 MB
            sys.stdout.buffer.write(block)
        """,
    )
    probe = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from agent.probes.nvidia_smi import NvidiaSmiRunner
        run = NvidiaSmiRunner({str(smi)!r}, timeout_s=60).run()
        # VmHWM, not ru_maxrss: ru_maxrss survives exec, so it would carry the forking test process's size
        hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
        print(run.output_capped, run.timed_out, len(run.output), hwm)
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    capped, timed_out, length, maxrss_kib = out.stdout.split()
    assert (capped, timed_out) == ("True", "False") and int(length) == 4 << 20  # stopped at the cap, not at the timeout
    assert int(maxrss_kib) < 120 * 1024, f"peak RSS {int(maxrss_kib) // 1024} MiB (was 1.1 GiB)"
    # and the probe says what happened
    r = probe_nvidia_smi(NvidiaSmiRunner(str(smi), timeout_s=60, max_output_bytes=1 << 16))
    assert [(f.kind, f.reason) for f in r.findings] == [("output_too_large", Reason.NVIDIA_SMI_FAILED)]
    assert not r.ran and r.count is None


@pytest.mark.parametrize("keep_stdout", [False, True])
def test_setsid_grandchild_does_not_leak_one_process_per_poll(tmp_path, keep_stdout):
    pidfile = tmp_path / "grandchildren"
    table = fixture_path("smi-table-healthy-h100x8-550.90.07-gpud-fixture.txt").read_text()
    smi = stand_in(tmp_path, daemons(pidfile, (True,), close_stdio=not keep_stdout) + f"sys.stdout.write({table!r})\n")
    runner = NvidiaSmiRunner(str(smi), timeout_s=30)
    for poll in range(3):
        r = probe_nvidia_smi(runner)
        assert r.ran and r.count == 8 and not r.timed_out, r.findings  # a daemon holding stdout stalls no run
        started = pids_in(pidfile)
        assert len(started) == poll + 1
        survivors = [p for p in started if alive(p)]
        assert survivors == [], f"poll {poll}: leaked {survivors} (before the fix: one more per poll)"


def test_timeout_kills_the_whole_group_and_setsid_descendants(tmp_path):
    pidfile = tmp_path / "children"
    smi = stand_in(
        tmp_path,
        f"""
        import os, signal, sys, time
        for detach in (False, True):
            if os.fork() == 0:
                if detach:
                    os.setsid()
                with open({str(pidfile)!r}, "a") as fh:
                    fh.write(f"{{os.getpid()}}\\n")
                signal.pause()  # lives until killed
        print("| NVIDIA-SMI", flush=True)
        signal.pause()  # lives until killed
        """,
    )
    runner = NvidiaSmiRunner(str(smi), timeout_s=1.5, reap_grace_s=10)
    r = probe_nvidia_smi(runner)
    assert r.timed_out and [f.kind for f in r.findings] == ["timeout"]  # killed and reaped, not abandoned as hung
    kids = wait_for(lambda: len(pids_in(pidfile)) == 2, 10, what="both children") and pids_in(pidfile)
    assert [p for p in kids if alive(p)] == []


def test_missing_and_non_executable_binaries_are_could_not_check(tmp_path):
    r = probe_nvidia_smi(NvidiaSmiRunner(str(tmp_path / "missing"), 1))
    assert not r.ran and r.findings[0].severity is Severity.UNCHECKED and "not found" in r.findings[0].message
    plain = tmp_path / "plain"
    plain.write_text("not a program")
    r = probe_nvidia_smi(NvidiaSmiRunner(str(plain), 1))
    assert not r.ran and r.findings[0].severity is Severity.UNCHECKED and "not an executable" in r.findings[0].message


def test_exit_code_and_signal_pass_through_the_supervisor(tmp_path):
    assert NvidiaSmiRunner(str(stand_in(tmp_path, "import sys; sys.exit(15)")), 10).run().exit_code == 15
    killed = stand_in(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "segv")
    assert NvidiaSmiRunner(str(killed), 10).run().exit_code == 128 + signal.SIGSEGV


# -- bounded HTTP server -------------------------------------------------------------------------------------------


def http_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("http"))


def get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def server():
    state = {"healthy": (True, "ok"), "ready": (True, "ready")}
    before = http_threads()
    srv = HealthServer(
        "127.0.0.1:0",
        Metrics().registry,
        lambda: state["healthy"],
        lambda: state["ready"],
        max_connections=64,
        head_timeout_s=1.0,
    ).start()
    srv.state = state  # type: ignore[attr-defined]
    yield srv
    srv.stop()
    assert http_threads() == before


def test_idle_connections_cost_no_thread_and_health_still_answers(server):
    base = http_threads()
    assert base <= 1 + server.workers <= 9
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(400)]
    try:
        for s in idle[:50]:
            s.sendall(b"GET /healthz HTTP/1.1\r\n")  # slowloris: a head that never ends
        assert http_threads() == base, "before the fix: one thread per idle connection (1,417 seen)"
        code, body = get(server.port, "/healthz")
        assert (code, body) == (200, b"ok\n")
        assert http_threads() == base
    finally:
        for s in idle:
            s.close()


def closed_by_server(s: socket.socket) -> bool:
    """The server closed the connection without an answer (EOF, or a reset when input was left unread)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_and_slow_connections_time_out(server):
    quiet = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    slow = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    # unanswered; the sockets' own 10 s timeout raises if the server never closes them
    assert closed_by_server(quiet) and closed_by_server(slow)
    big = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    big.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000)
    assert closed_by_server(big)  # a head over MAX_HEAD is closed at once
    for s in (quiet, slow, big):
        s.close()


def test_endpoints_keep_their_behaviour(server):
    assert get(server.port, "/readyz") == (200, b"ready\n")
    server.state["healthy"] = (False, "no check cycle completed for 95s")
    assert get(server.port, "/healthz") == (503, b"no check cycle completed for 95s\n")
    assert get(server.port, "/livez")[0] == 503
    code, body = get(server.port, "/metrics")
    assert code == 200 and b"# HELP" in body
    assert get(server.port, "/nope")[0] == 404
    server.state["ready"] = None  # a callback that fails answers 500, it does not kill a worker
    assert get(server.port, "/readyz")[0] == 500
    assert get(server.port, "/healthz")[0] == 503


def test_many_concurrent_clients_are_all_answered(server):
    results: list[int] = []

    def client() -> None:
        results.append(get(server.port, "/metrics", timeout=30)[0])

    threads = [threading.Thread(target=client) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 40 and set(results) <= {200, 503} and results.count(200) >= 16


# -- any --node-json shape: a clear could-not-check, never a traceback ----------------------------------------------

MALFORMED = [
    {"status": {"capacity": "8"}},
    {"status": []},
    {"status": {"capacity": {"nvidia.com/gpu": "abc"}}},
    {"status": {"capacity": {"nvidia.com/gpu": {"n": 8}}}},
    {"status": {"capacity": {"nvidia.com/gpu": -8}}},
    {"status": {"capacity": {"nvidia.com/gpu": 8.5}}},
    {"status": {"capacity": {"nvidia.com/gpu": True}}},
    {"status": {"allocatable": ["nvidia.com/gpu"]}},
    {"metadata": "x"},
    {"metadata": {"labels": ["a"]}},
    {"metadata": {"labels": {"nvidia.com/mig.strategy": 5}}},
]


@pytest.mark.parametrize("doc", MALFORMED, ids=[json.dumps(d)[:40] for d in MALFORMED])
def test_malformed_node_is_could_not_check(doc):
    pc = plugin_counts(doc, None)
    assert pc.malformed and pc.physical is None
    f = plugin_findings(pc, True, 0)
    assert [(x.severity, x.kind) for x in f] == [(Severity.UNCHECKED, "malformed_node")]
    assert "malformed Node" in f[0].message


@pytest.mark.parametrize(
    "doc",
    [*MALFORMED, [], "8", 8, None, {"kind": 5}, "{not json", '{"status": {"capacity": {"nvidia.com/gpu": 1e400}}}'],
)
def test_check_with_malformed_node_json_is_one_line_or_unknown(simhost, tmp_path, capsys, doc):
    rc = cli_main(["check", *simhost.check_args(), "--json", "--node-json", node_json(tmp_path, doc)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if err.strip():  # rejected as bad input: exactly one line naming it, exit 2
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "node-json" in err, (rc, err)
    else:  # read, but the plugin check could not run: Unknown (exit 3), saying why
        v = json.loads(out)
        assert rc == 3 and v["status"] == "Unknown" and "malformed Node" in v["message"], (rc, out)


def test_odd_but_valid_quantities_and_labels():
    assert [parse_count(v) for v in ("8", "1k", "2Ki", 8, "08")] == [8, 1000, 2048, 8, 8]
    assert [parse_count(v) for v in ("8.0", "-1", "1e3", "", " 8", True, None, 10**30)] == [None] * 8
    pc = plugin_counts(gpu_node("32", {"nvidia.com/gpu.replicas": "many"}), None)
    assert pc.malformed is None and pc.physical is None and "not a count" in pc.physical_note
    pc = plugin_counts(gpu_node("8", {"nvidia.com/mig.strategy": "bogus"}), None)
    assert pc.physical is None and "unknown MIG strategy" in pc.physical_note


def test_no_traceback_from_the_cli_in_a_subprocess(simhost, tmp_path):
    """The real entry point, as the DaemonSet and operators run it."""
    path = node_json(tmp_path, {"status": {"capacity": "8"}})
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", *simhost.check_args(), "--node-json", path],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout, out.stderr


def test_sysfs_attributes_are_read_bounded(simhost, monkeypatch):
    from agent.probes.pci import list_pci_gpus

    read_sizes: list[int] = []
    real_read = os.read

    def counting_read(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        read_sizes.append(len(data))
        return data

    monkeypatch.setattr(os, "read", counting_read)
    dev = simhost.devices / f"{simhost.gpus[0].address.kernel}.0"
    (dev / "class").write_text("0x030200" + " " * 20_000_000)  # a huge attribute is not read whole
    gpus = list_pci_gpus(str(simhost.sysfs))
    assert len(gpus) == 8 and read_sizes and max(read_sizes) <= 64, max(read_sizes)
    (dev / "class").write_text("0x030200" + "z" * 20_000_000)  # nor parsed: it is not a class, the GPU is skipped
    read_sizes.clear()
    gpus = list_pci_gpus(str(simhost.sysfs))
    assert len(gpus) == 7 and simhost.gpus[0].address not in {g.address for g in gpus}
    assert read_sizes and max(read_sizes) <= 64, max(read_sizes)  # at most 64 bytes of any attribute


def test_check_with_a_wedged_sysfs_file_ends_unknown_with_one_line(tmp_path):
    """A FIFO nobody writes at an InfiniBand port's `state` (a wedged HCA): `gpu-ready check` in a real process ends
    (its blocked reader thread does not hold up the exit), exit 3 Unknown, and one line names the file."""
    host = SimHost(tmp_path / "h", pcie_bridges=True)
    for i in range(8):
        host.add_rail(f"mlx5_{i}", gpu=i)
    wedged = host.wedge(host.ib_port_file("mlx5_6", "state"))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "agent", "check", *host.check_args()],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
        )
    finally:
        host.unwedge(content="4: ACTIVE\n")
    assert out.returncode == 3 and "Traceback" not in out.stderr + out.stdout, out.stderr
    named = [line for line in out.stdout.splitlines() if str(wedged) in line]
    assert len(named) == 1 and "did not answer within" in named[0], out.stdout
    assert "GPUReady=Unknown  reason=CheckFailed" in out.stdout
