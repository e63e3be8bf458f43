"""Bad input gets one clear line and exit 2, never a traceback; the agent never stalls and never reports True
when it could not check. Huge integers and deep nesting in a settings file, GPU_READY_CONFIG, a preflight
profile or a results file; FIFOs, devices and /dev/stdin where a file is expected; endless kernel-log sources;
argparse errors for every subcommand; the latch state when its directory cannot be written."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import config, settings
from agent.cli import main as cli_main
from agent.kernel_log.source import KmsgSource, KmsgUnavailable, format_record
from agent.model import PciAddress, Status, XidEvent
from agent.preflight import Profile, ProfileError, read_results
from agent.settings import MAX_NESTING, in_range, load_json, load_yaml, to_float, to_int, to_int_list
from agent.state import LatchState, read_boot_id
from testkit.harness import returns_within

HUGE = int("9" * 400)  # float(HUGE) is an OverflowError; f"{HUGE:g}" too
WAIT_S = 60.0  # a bound for waits on a loaded machine, never a measured duration


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`gpu-ready <argv>` in this process: (exit code, stdout, stderr); argparse's exit is an exit code too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def assert_one_line(code: int, err: str, *wanted: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for w in wanted:
        assert w in lines[0], lines[0]


def run_process(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """`gpu-ready <argv>` as its own process, for inputs that could block or spin: killed after WAIT_S."""
    return subprocess.run([sys.executable, "-m", "agent", *argv], capture_output=True, text=True, timeout=WAIT_S, **kw)


def deep_flow(n: int, leaf: str = "1") -> str:
    return "[" * n + leaf + "]" * n


def deep_block(n: int) -> str:
    return "".join(" " * i + "a:\n" for i in range(n)) + " " * n + "1\n"


# -- 1. huge integers ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc",
    [
        f"recoveryPolls: {HUGE}\n",  # in_range(to_int) formatted it with :g -> OverflowError
        f"pollInterval: {HUGE}\n",
        f"expectedGpus: {HUGE}\n",
        f"xidFatal: [{HUGE}]\n",
        f"pcieBusyUtilization: {-HUGE}\n",
        "recoveryPolls: " + "9" * 5000 + "\n",  # past Python's int-from-string limit: a ValueError in the loader
        "pollInterval: 2024-13-01\n",  # a date no constructor takes
    ],
)
def test_huge_integer_in_config_file_is_one_line(tmp_path: Path, doc: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(doc)
    code, _, err = run_cli(["check", "--config", str(path)])
    assert_one_line(code, err, "configuration error")


def test_huge_integer_in_config_from_the_environment_is_one_line(tmp_path: Path, monkeypatch: Any) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"recoveryPolls": HUGE}))
    monkeypatch.setenv("GPU_READY_CONFIG", str(path))
    code, _, err = run_cli(["check"])
    assert_one_line(code, err, "recovery-polls", "at most 18 digits")


@pytest.mark.parametrize("key", ["gpuCount", "memoryPerGpuMiB", "pcieGen", "burnInSeconds", "p2pMinGBps"])
def test_huge_integer_in_preflight_profile_is_one_line(tmp_path: Path, key: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"{key}: {HUGE}\n")
    code, _, err = run_cli(["preflight", "--profile", str(path), "--gates", "spec"])
    assert_one_line(code, err, key)


@pytest.mark.parametrize("value", [HUGE, -HUGE, 10**18, float(10**300), "1e300", [HUGE], {"a": HUGE}])
def test_converters_bound_integers_by_magnitude(value: Any) -> None:
    for conv in (to_int, to_float, in_range(to_int, 0, 10), in_range(to_float, 0, 10), to_int_list):
        with pytest.raises(ValueError) as ei:
            conv(value)
        assert len(str(ei.value)) < 200 and "\n" not in str(ei.value)


def test_alias_bomb_is_refused_without_expanding_it(tmp_path: Path) -> None:
    """Nine levels of nine aliases is 9**9 items as a string: a converter refuses a list before str()."""
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    doc = load_yaml("\n".join(lines) + "\n")
    for conv in (to_int, to_float, settings.to_bool, settings.choice("a", "b"), to_int_list, settings.to_str):
        with pytest.raises(ValueError) as ei:
            conv({"x": doc["a8"]} if conv is to_int_list else doc["a8"])
        assert len(str(ei.value)) < 200


# -- 1. deep nesting -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", [deep_flow(600), deep_flow(30_000), "pollInterval: " + deep_flow(600), deep_block(300)])
def test_deep_config_file_is_one_line(tmp_path: Path, monkeypatch: Any, doc: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(doc)
    code, _, err = run_cli(["check", "--config", str(path)])
    assert_one_line(code, err, "nested deeper than")
    monkeypatch.setenv("GPU_READY_CONFIG", str(path))
    code, _, err = run_cli(["run", "--node-name", "n"])
    assert_one_line(code, err, "nested deeper than")


def test_deep_profile_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("serving: " + deep_flow(5000) + "\n")
    code, _, err = run_cli(["preflight", "--profile", str(path), "--gates", "spec"])
    assert_one_line(code, err, "nested deeper than")


def test_deep_documents_are_refused_before_anything_is_built(monkeypatch: Any) -> None:
    """The depth is counted on the parser's events: nothing is constructed (no recursion, linear time)."""
    built: list[str] = []
    real_load = settings.yaml.load

    def load(*a: Any, **k: Any) -> Any:
        built.append("load")
        return real_load(*a, **k)

    monkeypatch.setattr(settings.yaml, "load", load)
    for doc in (deep_flow(MAX_NESTING + 1), deep_block(MAX_NESTING + 1), "- " * (MAX_NESTING + 1) + "1"):
        with pytest.raises(ValueError, match="nested deeper than"):
            load_yaml(doc)
    assert built == []
    assert load_yaml(deep_flow(MAX_NESTING)) is not None and built == ["load"]
    with pytest.raises(ValueError, match="nested deeper than"):
        load_json(deep_flow(100_000))
    with pytest.raises(ValueError, match="nested deeper than"):
        load_json('{"a": ' * (MAX_NESTING + 1) + "1" + "}" * (MAX_NESTING + 1))


def test_deep_results_file_is_a_failed_result_not_a_traceback(tmp_path: Path) -> None:
    """The record step then labels the node failed (with an Event) instead of dying with the node cordoned."""
    cases = {
        "deep.json": '{"gates": ' + deep_flow(100_000, "") + "}",
        "deep-evidence.json": '{"gates": [{"gate": "spec", "status": "pass", "evidence": ' + deep_flow(900) + "}]}",
        "huge.json": json.dumps({"gates": [{"gate": "spec", "status": "pass", "duration_s": HUGE}]}),
        "typed.json": json.dumps({"gates": [{"gate": "spec", "status": "pass", "timeout_s": {"a": 1}}]}),
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        got = read_results(str(tmp_path / name))
        assert [r.status for r in got] == ["fail"] and "no usable results" in got[0].reason, (name, got)


# -- 1. preflight cordon / record without usable credentials --------------------------------------------------


@pytest.mark.parametrize("step", ["cordon", "record", "all"])
@pytest.mark.parametrize("kubeconfig", ["missing", "garbage", "deep", "none"])
def test_preflight_steps_without_a_usable_kubeconfig_are_one_line(
    tmp_path: Path, monkeypatch: Any, step: str, kubeconfig: str
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    profile = tmp_path / "p.yaml"
    profile.write_text("gpuCount: 8\n")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"passed": True, "gates": [{"gate": "spec", "status": "pass"}]}))
    kc = tmp_path / "kubeconfig"
    kc.write_text({"garbage": "garbage: [\n", "deep": deep_flow(5000)}.get(kubeconfig, ""))
    argv = ["preflight", "--profile", str(profile), "--step", step, "--node", "n", "--results", str(results)]
    argv += ["--gates", "spec", "--nvidia-smi", str(tmp_path / "no-smi")]
    if kubeconfig != "none":
        argv += ["--kubeconfig", str(kc if kubeconfig != "missing" else tmp_path / "absent")]
    code, _, err = run_cli(argv)
    assert_one_line(code, err, "gpu-ready preflight:")
    assert "kubeconfig" in err or "credentials" in err, err


# -- 2. files that never end, never come, or are too big ---------------------------------------------------------


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def test_config_fifo_is_refused_not_waited_on(fifo: Path) -> None:
    r = run_process(["check", "--config", str(fifo)])
    assert_one_line(r.returncode, r.stderr, "not a regular file (a FIFO)")


def test_config_dev_stdin_is_refused_not_read(tmp_path: Path) -> None:
    """stdin a pipe nobody writes to or closes: reading it would wait forever."""
    with subprocess.Popen(
        [sys.executable, "-m", "agent", "check", "--config", "/dev/stdin"],
        stdin=subprocess.PIPE,  # kept open: nothing is written, nothing is closed
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as p:
        try:
            p.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail("gpu-ready waited on /dev/stdin")
        assert p.stderr is not None
        err = p.stderr.read()
    assert_one_line(p.returncode, err, "not a regular file")


def without_waiting_on(fifo: Path, fn: Any) -> Any:
    """fn() on a thread; if it is still waiting on the FIFO after WAIT_S, a writer comes and goes (so that the
    thread ends) and the test fails."""
    return returns_within(fn, WAIT_S, lambda: os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)))


def test_profile_and_results_fifos_are_refused(fifo: Path, tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="not a regular file"):
        without_waiting_on(fifo, lambda: Profile.load(str(fifo)))
    got = without_waiting_on(fifo, lambda: read_results(str(fifo)))
    assert [r.status for r in got] == ["fail"] and "not a regular file" in got[0].reason


def test_boot_id_file_that_is_not_a_regular_file_is_unknown(fifo: Path) -> None:
    """The loop reads the boot ID every cycle: a FIFO there would stop it for good."""
    assert without_waiting_on(fifo, lambda: read_boot_id(str(fifo))) == "unknown"
    assert read_boot_id("/dev/zero") == "unknown"


def test_big_config_is_refused_before_it_is_read_or_parsed(tmp_path: Path, monkeypatch: Any) -> None:
    """A 1 MiB flow list (seconds of YAML parsing) and a 1 GiB sparse file: refused by their size alone."""
    parsed: list[str] = []

    def counting(name: str) -> Any:
        real = getattr(yaml, name)

        def counted(*a: Any, **k: Any) -> Any:
            parsed.append(name)
            return real(*a, **k)

        return counted

    for name in ("load", "safe_load"):
        monkeypatch.setattr(yaml, name, counting(name))
    reads: list[int] = []
    real_read = os.read

    def read(fd: int, n: int) -> bytes:
        reads.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", read)
    flow = tmp_path / "flow.yaml"
    flow.write_text("xidFatal: [" + "1, " * 349_000 + "1]\n")
    sparse = tmp_path / "sparse.yaml"
    with open(sparse, "wb") as fh:
        fh.truncate(1 << 30)  # 1 GiB that costs nothing
    for path in (flow, sparse):
        with pytest.raises(config.ConfigError, match="larger than"):
            config.load(None, environ={"GPU_READY_CONFIG": str(path)})
        code, _, err = run_cli(["preflight", "--profile", str(path)])
        assert_one_line(code, err, "larger than")
    assert parsed == [] and reads == []


def test_config_just_over_the_limit_is_refused_and_one_under_is_parsed(tmp_path: Path) -> None:
    """A big flow list (the slow case for a YAML parser) at the limit is parsed; a byte more is refused."""
    limit = config.CONFIG_FILE_LIMIT
    head, tail = "xidFatal: [", "]\n"
    body = ("1, " * (limit // 3))[: limit - len(head) - len(tail) - 1].rstrip(", ")
    path = tmp_path / "c.yaml"
    path.write_text(head + body + tail)
    assert path.stat().st_size <= limit
    with pytest.raises(config.ConfigError, match="at most 1024 entries"):
        config.load(None, environ={"GPU_READY_CONFIG": str(path)})
    path.write_text(head + body + " " * (limit - path.stat().st_size + 1) + tail)
    with pytest.raises(config.ConfigError, match="larger than"):
        config.load(None, environ={"GPU_READY_CONFIG": str(path)})


@pytest.mark.parametrize("source", ["/dev/zero", "/dev/urandom", "/dev/null", "fifo", "dir"])
def test_kmsg_source_that_is_neither_kmsg_nor_a_file_is_refused(tmp_path: Path, source: str) -> None:
    if source == "fifo":
        os.mkfifo(tmp_path / "fifo")
    path = {"fifo": str(tmp_path / "fifo"), "dir": str(tmp_path)}.get(source, source)
    src = KmsgSource(path)
    with pytest.raises(KmsgUnavailable, match=r"only /dev/kmsg or a regular file|not /dev/kmsg"):
        src.open()
    assert src.fd is None and not src.is_device


@pytest.mark.parametrize("path", ["/proc/cpuinfo", "/proc/self/status", "/sys/kernel/mm/transparent_hugepage/enabled"])
def test_kmsg_source_in_procfs_or_sysfs_is_refused(path: str) -> None:
    """A procfs or sysfs file is a regular file of size 0 that answers every read anew: never a kernel log."""
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    src = KmsgSource(path)
    with pytest.raises(KmsgUnavailable, match="procfs or sysfs file"):
        src.open()
    assert src.fd is None


def test_a_fifo_at_the_state_file_is_corrupt_not_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "state.json")
    done: list[str] = []
    t = threading.Thread(target=lambda: done.append(LatchState(str(tmp_path), "b").load()), daemon=True)
    t.start()
    t.join(30)
    assert done == ["corrupt"]  # refused before a byte is read (a plain read would block here for good)


def test_check_with_kmsg_dev_zero_finishes_and_reads_could_not_check(simhost: Any) -> None:
    r = run_process(["check", *simhost.check_args(), "--kmsg", "/dev/zero", "--json"])
    verdict = json.loads(r.stdout)
    assert r.returncode == 3 and verdict["status"] == "Unknown" and "/dev/zero" in verdict["message"], r.stdout


def test_agent_with_kmsg_dev_zero_reports_the_kernel_log_unchecked(simhost: Any) -> None:
    """`run` reads the whole log before its first verdict (Agent.start): that read ends, the watcher names the
    problem, and the cycle carries it as could-not-check (the verdict is never True)."""
    from agent.kube.client import KubeApi
    from agent.runner import Agent

    simhost.check_args()  # makes the device nodes
    cfg = config.load(
        None,
        environ={},
        overrides={
            "node_name": "n",
            "state_dir": str(simhost.state_dir),
            "boot_id_file": str(simhost.boot_id_file),
            "kmsg": "/dev/zero",
            "nvidia_smi": str(simhost.nvidia_smi),
            "sysfs_root": str(simhost.sysfs),
            "dev_root": str(simhost.dev),
            "proc_root": str(simhost.proc),
            "nvml": "off",
            "node_watch": False,
            "api_timeout": 2,
        },
    )
    agent = Agent(cfg, api=KubeApi.from_token("https://127.0.0.1:1", "t"))
    try:
        reader = threading.Thread(target=agent.kmsg.read_available, daemon=True)
        reader.start()
        reader.join(WAIT_S)
        assert not reader.is_alive(), "reading /dev/zero as the kernel log never ended"
        assert agent.kmsg.problem is not None and "/dev/zero" in agent.kmsg.problem
        agent.cycle()
        assert agent.obs is not None
        assert any(f.kind == "kmsg_unavailable" for f in agent.obs.findings)
        assert agent.evaluate().status is not Status.TRUE
    finally:
        agent.kmsg.close()


def test_file_batches_are_bounded_even_when_every_line_is_dropped(tmp_path: Path) -> None:
    """User-space records (dropped without --kmsg-trust-user) do not make one batch read the whole file, and a
    batch that ends on its bound is not taken for the end of the log."""
    path = tmp_path / "kmsg"
    dropped = "".join(format_record(f"user line {i}", i, facility=1) for i in range(60_000))
    xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."
    path.write_text(dropped + format_record(xid, 60_000))
    src = KmsgSource(str(path))
    try:
        records, _ = src.read_available(100)
        assert records == [] and src.more and src._offset < path.stat().st_size
        src.close()
        src = KmsgSource(str(path))
        got = [r.text for batch in src.drain(100) for r in batch]
        assert got == [xid] and not src.more
    finally:
        src.close()


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="needs a readable /dev/kmsg")
def test_device_batches_are_bounded_by_reads() -> None:
    src = KmsgSource("/dev/kmsg", trust_user=False)
    try:
        src.read_available(1)
        first_batch_reads = src.records_read
        assert first_batch_reads <= 1
        total = sum(len(b) for b in src.drain(50))
        assert total <= src.records_read and not src.more
    finally:
        src.close()


# -- 3. argparse errors: one line, for every subcommand ------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        ([], "gpu-ready"),
        (["bogus"], "gpu-ready"),
        (["--bogus"], "gpu-ready"),
        (["check", "--bogus"], "gpu-ready check"),
        (["check", "--kmsg"], "gpu-ready check"),
        (["check", "--node", "a", "--node-json", "b"], "gpu-ready check"),
        (["check", "extra"], "gpu-ready check"),
        (["gpus", "--bogus"], "gpu-ready gpus"),
        (["gpus", "--json", "extra"], "gpu-ready gpus"),
        (["gpus", "--config"], "gpu-ready gpus"),
        (["run", "--bogus"], "gpu-ready run"),
        (["run", "--poll-interval"], "gpu-ready run"),
        (["preflight"], "gpu-ready preflight"),
        (["preflight", "--profile"], "gpu-ready preflight"),
        (["preflight", "--profile", "p", "--step", "bad"], "gpu-ready preflight"),
        (["preflight", "--profile", "p", "--bogus"], "gpu-ready preflight"),
    ],
)
def test_usage_errors_are_one_line(argv: list[str], prog: str) -> None:
    code, out, err = run_cli(argv)
    assert out == "" and code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{prog}: error: "), err


@pytest.mark.parametrize("cmd", ["check", "gpus", "run", "preflight"])
def test_help_is_still_the_whole_help_and_shows_percent_signs(cmd: str) -> None:
    code, out, err = run_cli([cmd, "--help"])
    assert code == 0 and err == "" and out.count("\n") > 10 and "option_strings" not in out
    if cmd != "preflight":
        assert "utilisation % at which" in " ".join(out.split())


# -- 4. the latch state when its directory cannot be written ---------------------------------------------------


def fatal_event(bus: int = 0x3B) -> XidEvent:
    a = PciAddress(0, bus, 0)
    return XidEvent(79, a, a.kernel, True, "Xid 79", "xid", "GPU has fallen off the bus", "RESET_GPU")


def test_unwritable_state_dir_is_known_at_load_before_any_latch(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    problems: list[str] = []
    s = LatchState(str(blocker / "state"), "b", on_write_failure=problems.append)
    assert s.load() == "new"
    assert s.write_problem is not None and s.dirty and len(problems) == 1
    assert s.retry() is False and s.write_problem is not None and len(problems) == 2
    blocker.unlink()
    assert s.retry() is True and s.write_problem is None and not s.dirty
    assert json.loads((blocker / "state" / "state.json").read_text())["boot_id"] == "b"


def test_every_failed_write_sets_the_problem_and_a_success_clears_it(tmp_path: Path) -> None:
    s = LatchState(str(tmp_path / "state"), "b")
    assert s.load() == "new" and s.write_problem is None
    (tmp_path / "state" / "state.json").unlink()
    (tmp_path / "state").rename(tmp_path / "moved")
    (tmp_path / "state").write_text("")  # the state dir is now a file: every write fails
    assert s.latch(fatal_event(), 1.0) is not None
    assert s.write_problem is not None and s.write_failures == 1
    assert s.clear_before(2.0, None) and s.write_failures == 2 and s.write_problem is not None
    assert s.snapshot() == []  # memory holds the newest state while the file is behind
    (tmp_path / "state").unlink()
    assert s.retry() and s.write_problem is None
    assert json.loads((tmp_path / "state" / "state.json").read_text())["cleared_before"] == 2.0


def test_a_failed_write_leaves_the_previous_state_file_whole(tmp_path: Path, monkeypatch: Any) -> None:
    s = LatchState(str(tmp_path), "b")
    s.load()
    s.latch(fatal_event(0x3B), 1.0)
    before = (tmp_path / "state.json").read_text()

    def no_space(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    s.latch(fatal_event(0x5D), 2.0)
    assert s.write_problem is not None and "No space left" in s.write_problem
    assert (tmp_path / "state.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # the temporary file went too
    monkeypatch.undo()
    assert s.retry() and len(json.loads((tmp_path / "state.json").read_text())["faults"]) == 2


def test_stale_temp_files_of_our_own_naming_are_removed_on_load(tmp_path: Path) -> None:
    """A crash between writing the temporary file and renaming it leaves `.state.json.<random>.tmp`."""
    s = LatchState(str(tmp_path), "b")
    s.load()
    s.latch(fatal_event(), 1.0)
    (tmp_path / ".state.json.k2j4_x9a.tmp").write_text('{"version": 1, "boot_id": "b", "fau')
    (tmp_path / ".state.json.zzzzzzzz.tmp").write_text("")
    keep = [".other.tmp", "state.json.corrupt-1", "notes.tmp", ".state.json"]
    for name in keep:
        (tmp_path / name).write_text("x")
    t = LatchState(str(tmp_path), "b")
    assert t.load() == "loaded" and len(t.snapshot()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*keep, "state.json"])


def test_agent_health_fails_while_the_latch_cannot_be_written(tmp_path: Path, simhost: Any) -> None:
    from agent.kube.client import KubeApi
    from agent.runner import Agent

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cfg = config.load(
        None,
        environ={},
        overrides={"node_name": "n", "state_dir": str(blocker / "state"), "kmsg": str(simhost.kmsg)},
    )
    agent = Agent(cfg, api=KubeApi.from_token("https://127.0.0.1:1", "t"))
    try:
        agent.state.load()
        ok, why = agent.healthy()
        assert not ok and "not persisted" in why
        blocker.unlink()
        assert agent.state.retry()
        assert agent.healthy()[0]
    finally:
        agent.kmsg.close()
