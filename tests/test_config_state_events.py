"""Settings, the latched-fault state file, Event aggregation."""

from __future__ import annotations

import json

import pytest

from agent import config
from agent.model import PciAddress, XidEvent
from agent.report.events import EventReporter
from agent.state import LatchState


def test_precedence_flag_env_file_default(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("pollInterval: 10\nxidIgnore: [109]\nexpectedGpus: 8\n")
    args = config.argparse.Namespace(config=str(f), poll_interval=None, nvml="off")
    cfg = config.load(args, environ={"GPU_READY_POLL_INTERVAL": "20", "NODE_NAME": "n1"})
    assert (cfg.poll_interval, cfg.xid_ignore, cfg.expected_gpus, cfg.nvml, cfg.node_name) == (
        20.0,
        (109,),
        8,
        "off",
        "n1",
    )
    assert cfg.heartbeat_interval == 300.0


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"GPU_READY_POLL_INTERVAL": "0"}, "poll-interval"),
        ({"GPU_READY_NVML": "maybe"}, "nvml"),
        ({"GPU_READY_XID_FATAL": "79", "GPU_READY_XID_IGNORE": "79"}, "both lists"),
        ({"GPU_READY_RECOVERY_POLLS": "two"}, "recovery-polls"),
        ({"GPU_READY_LOG_LEVEL": "bogus"}, "log-level"),
        ({"GPU_READY_METRICS_ADDRESS": "nonsense"}, "metrics-address"),
        ({"GPU_READY_METRICS_ADDRESS": "abc"}, "metrics-address"),
        ({"GPU_READY_METRICS_ADDRESS": "0.0.0.0:70000"}, "metrics-address"),
        ({"GPU_READY_KUBECONFIG": "/nonexistent"}, "kubeconfig"),
        ({"GPU_READY_EVENT_NAMESPACE": "Not_A_Namespace"}, "event-namespace"),
        ({"GPU_READY_EVENT_NAMESPACE": "gpu-ready"}, "event-namespace"),
        ({"GPU_READY_PREFLIGHT_LABEL": "a b"}, "preflight-label"),
        ({"GPU_READY_EXPECTED_GPUS": "8.5"}, "expected-gpus"),
        ({"GPU_READY_EXPECTED_GPUS": "9" * 5000}, "expected-gpus"),
        ({"GPU_READY_XID_FATAL": "79,-1"}, "xid-fatal"),
        ({"GPU_READY_POLL_INTERVAL": "1e300"}, "poll-interval"),
    ],
)
def test_bad_values_name_the_setting(env, needle):
    with pytest.raises(config.ConfigError, match=needle):
        config.load(None, environ=env)


FLOATS = [s.name for s in config.SETTINGS if isinstance(s.default, float)]


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("bad", ["nan", "NaN", "inf", "-inf", "Infinity"])
def test_every_float_setting_rejects_non_finite_values(name, bad):
    """`--poll-interval nan` busy-looped and `inf` killed the loop thread: refused at start, naming it."""
    flag = name.replace("_", "-")
    with pytest.raises(config.ConfigError, match=f"invalid {flag}.*finite"):
        config.load(None, environ={f"GPU_READY_{name.upper()}": bad})
    with pytest.raises(config.ConfigError, match=f"invalid {flag}"):
        config.load(None, environ={}, overrides={name: float(bad)})


def test_float_settings_are_all_covered():
    assert set(FLOATS) >= {"poll_interval", "heartbeat_interval", "nvidia_smi_timeout", "api_timeout", "nvml_timeout"}


def test_config_file_values_are_validated_too(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("pollInterval: .nan\n")
    with pytest.raises(config.ConfigError, match="pollInterval in"):
        config.load(None, environ={"GPU_READY_CONFIG": str(f)})
    f.write_text("expectedGpus: true\n")
    with pytest.raises(config.ConfigError, match="expected-gpus"):
        config.load(None, environ={"GPU_READY_CONFIG": str(f)})
    f.write_text("logLevel: WARNING\nrecoveryPolls: 3.0\n")
    cfg = config.load(None, environ={"GPU_READY_CONFIG": str(f)})
    assert (cfg.log_level, cfg.recovery_polls) == ("warning", 3)


def test_event_namespace_is_one_the_apiserver_accepts_for_a_node():
    # Events about a cluster-scoped object are accepted only in default or kube-system (422 otherwise).
    assert config.load(None, environ={}).event_namespace == "default"
    assert config.load(None, environ={"POD_NAMESPACE": "gpu-ready"}).event_namespace == "default"
    assert config.load(None, environ={"GPU_READY_EVENT_NAMESPACE": "kube-system"}).event_namespace == "kube-system"


def test_config_is_frozen_and_typed():
    import dataclasses

    cfg = config.defaults(node_name="n1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.poll_interval = 1.0  # type: ignore[misc]
    assert not hasattr(cfg, "values") and [type(s) for s in cfg.sections] == list(config.SECTIONS)
    with pytest.raises(config.ConfigError, match="unknown setting 'pol_interval'"):
        config.defaults(pol_interval=1)


def test_converters_for_other_inputs_name_what_was_bad():
    """The preflight profile validates with the same converters (gpuCount: "8" is 8)."""
    assert config.convert(config.to_int, "8", "gpuCount in profile.yaml") == 8
    with pytest.raises(config.ConfigError, match=r"invalid gpuCount in profile\.yaml: expected an integer"):
        config.convert(config.to_int, "eight", "gpuCount in profile.yaml")
    with pytest.raises(config.ConfigError, match="finite"):
        config.convert(config.positive(config.to_float), "inf", "minBandwidth")


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "bogus"],
        ["--metrics-address", "nonsense"],
        ["--metrics-address", "abc"],
        ["--kubeconfig", "/nonexistent"],
        ["--poll-interval", "nan"],
        ["--poll-interval", "inf"],
        ["--api-timeout", "nan"],
        ["--nvidia-smi-timeout", "inf"],
    ],
)
def test_run_with_a_bad_setting_exits_2_with_one_line(argv, capsys):
    from agent.cli import main

    assert main(["run", "--node", "n1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and argv[0].lstrip("-") in err[0] and "Traceback" not in err[0], err


def help_of(command: str) -> str:
    from agent.cli import build_parser, command_parser

    return " ".join(command_parser(build_parser(with_preflight=False), command).format_help().split())


def test_each_command_shows_only_its_own_flags():
    """`run` takes every setting as a flag; `check` what changes a one-shot verdict (and, with --node, what the
    Node shows); `gpus` never reads the Node. The environment and the file set every setting for every command."""
    check, gpus, run = (config.flags_of(c) for c in ("check", "gpus", "run"))
    assert {s.name for s in run} == {s.name for s in config.SETTINGS if s.public}
    assert {s.name for s in gpus} < {s.name for s in check} < {s.name for s in run}
    run_only = {"poll_interval", "heartbeat_interval", "node_watch", "start_spread", "state_dir", "event_namespace"}
    run_only |= {"metrics_address", "require_preflight", "taints", "fencing", "node_name", "pod_resources_interval"}
    node_only = {"kubeconfig", "api_timeout", "condition_type", "taint_key", "fencing_effect", "mig_strategy"}
    assert run_only.isdisjoint(s.name for s in check) and (run_only | node_only).isdisjoint(s.name for s in gpus)
    assert node_only < {s.name for s in check}
    for command, flags in (("check", check), ("gpus", gpus), ("run", run)):
        text = help_of(command)
        assert all(f"{s.flag}, --no-{s.flag[2:]} " in text for s in flags if s.boolean), command
        assert ("--poll-interval" in text) == (command == "run") and ("--kubeconfig" in text) == (command != "gpus")
    assert "--node-name" not in help_of("run") and "--node NODE " in help_of("run")
    assert "0 GPUReady=True, 1 False, 3 Unknown" in help_of("check")


def test_boolean_flags_are_x_and_no_x_and_still_take_a_value():
    from agent.cli import build_parser

    parser = build_parser(with_preflight=False)

    def pcie(*argv: str) -> bool:
        return config.load(parser.parse_args(["check", *argv]), environ={}).pcie

    assert (pcie(), pcie("--no-pcie"), pcie("--pcie")) == (True, False, True)
    assert (pcie("--pcie=false"), pcie("--pcie", "off", "--json"), pcie("--pcie=yes")) == (False, False, True)
    assert pcie("--no-pcie", "--pcie") is True  # the last one wins
    with pytest.raises(config.ConfigError, match=r"invalid pcie \(--pcie\): expected true or false"):
        pcie("--pcie=maybe")


def test_one_name_for_the_node(monkeypatch):
    """`run --node` (what `check --node` is called too); `--node-name` still works, unlisted; and so do NODE_NAME
    and GPU_READY_NODE_NAME."""
    from agent.cli import build_parser

    parser = build_parser(with_preflight=False)

    def node(argv: list[str], environ: dict[str, str]) -> str | None:
        return config.load(parser.parse_args(["run", *argv]), environ=environ).node_name

    assert node(["--node", "a"], {"NODE_NAME": "b"}) == "a" and node(["--node-name", "a"], {}) == "a"
    assert node([], {"NODE_NAME": "b"}) == "b" and node([], {"GPU_READY_NODE_NAME": "c", "NODE_NAME": "b"}) == "c"
    with pytest.raises(config.ConfigError, match=r"invalid node-name \(--node\)"):
        node(["--node", "Not_A_Name"], {})


def test_log_level_from_the_environment_is_used(tmp_path, monkeypatch, capsys):
    """GPU_READY_LOG_LEVEL was ignored (logging was set from the flags only)."""
    from agent.cli import main

    monkeypatch.setenv("GPU_READY_LOG_LEVEL", "error")
    monkeypatch.setenv("GPU_READY_LOG_FORMAT", "json")
    monkeypatch.setenv("GPU_READY_KMSG", str(tmp_path / "none"))
    main(["check", "--nvidia-smi", str(tmp_path / "no-smi"), "--sysfs-root", str(tmp_path)])
    err = capsys.readouterr().err
    assert "kernel log" not in err  # would be logged at info/warning; error level hides them
    monkeypatch.setenv("GPU_READY_LOG_LEVEL", "debug")
    from agent.logs import get_logger

    main(["check", "--nvidia-smi", str(tmp_path / "no-smi"), "--sysfs-root", str(tmp_path)])
    get_logger().debug("probe-debug-line")
    assert "probe-debug-line" in capsys.readouterr().err


def test_unknown_file_key_is_rejected(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("pollIntervall: 10\n")
    with pytest.raises(config.ConfigError, match="unknown setting 'pollIntervall'"):
        config.load(None, environ={"GPU_READY_CONFIG": str(f)})


def ev(xid=79, bus=0x3B, seq=1):
    a = PciAddress(0, bus, 0)
    return XidEvent(xid, a, a.kernel, True, f"Xid {xid}", "xid", "X", "RESTART_BM", seq, 0)


def test_state_latch_persist_restart_and_boot_change(tmp_path):
    s = LatchState(str(tmp_path), "boot-a")
    assert s.load() == "new"
    assert s.latch(ev(), 100.0) is not None
    assert s.latch(ev(seq=2), 101.0) is None  # same fault once
    t = LatchState(str(tmp_path), "boot-a")
    assert t.load() == "loaded" and [f.xid for f in t.snapshot()] == [79]
    u = LatchState(str(tmp_path), "boot-b")
    assert u.load() == "boot_changed" and u.snapshot() == []


def test_state_clear_and_no_relatch_of_replayed_records(tmp_path):
    s = LatchState(str(tmp_path), "b")
    s.load()
    s.latch(ev(seq=5), 100.0)
    s.latch(ev(xid=48, seq=6), 200.0)
    gone = s.clear_before(150.0, read_seq=6)
    assert [f.xid for f in gone] == [79] and [f.xid for f in s.snapshot()] == [48]
    r = LatchState(str(tmp_path), "b")
    r.load()
    assert r.latch(ev(seq=5), 300.0) is None  # replayed from the ring buffer after a restart
    assert r.latch(ev(xid=95, seq=7), 300.0) is not None


def test_corrupt_state_is_moved_aside(tmp_path):
    (tmp_path / "state.json").write_text("[1, 2")
    s = LatchState(str(tmp_path), "b")
    assert s.load() == "corrupt" and "corrupt state file" in s.load_problem
    assert json.loads((tmp_path / "state.json").read_text())["faults"] == []
    assert len(list(tmp_path.glob("state.json.corrupt-*"))) == 1


class RecordingApi:
    def __init__(self):
        self.calls = []

    def create_event(self, ns, body):
        self.calls.append(("create", body["reason"], body["note"]))

    def patch_event(self, ns, name, patch):
        self.calls.append(("patch", patch["series"]["count"]))


def test_event_storm_is_bounded_and_aggregated():
    now = [1000.0]
    api = RecordingApi()
    r = EventReporter(api, "n", interval_s=300, wall=lambda: now[0])  # type: ignore[arg-type]
    for i in range(50_000):
        r.record("FatalXid", f"Xid 95 #{i}", gpu="0000:3b:00")
        if i % 1000 == 0:
            r.flush()
    r.flush()
    assert api.calls == [("create", "FatalXid", "Xid 95 #0")]
    now[0] += 301
    r.flush()
    assert api.calls[1] == ("patch", 50_000)
    now[0] += 301
    assert r.flush() == 0  # nothing new: nothing written
    r.record("FatalXid", "again", gpu="0000:3b:00")
    assert r.flush() == 1 and api.calls[-1][0] == "create"


def test_configuration_doc_lists_every_setting():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    for s in config.SETTINGS:
        listed = f"| `{s.flag}` | `{s.env_name}`" in doc and f"`{s.file_key}`" in doc
        assert listed == s.public, s.name  # a test seam (public=False) is not a setting a user sets
    # the table is the one the rows make (`make docs`): a row changed in code and not in the doc fails here
    assert f"{config.DOC_BEGIN}\n{config.settings_table()}\n{config.DOC_END}" in doc


# -- the state file cannot silently stop persisting ----------------------------------------------------


def test_concurrent_writers_never_lose_a_fault_or_leave_temp_files(tmp_path):
    """save() runs on the watcher and the loop thread at once: each write has its own temp file and the
    last write carries every fault latched before it."""
    import threading

    s = LatchState(str(tmp_path), "b")
    s.load()
    start = threading.Barrier(8)

    def writer(k: int) -> None:
        start.wait()
        for i in range(25):
            s.latch(ev(xid=1000 + k * 100 + i, bus=k, seq=None), 100.0)
            s.save()

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert s.write_problem is None and s.write_failures == 0
    on_disk = json.loads((tmp_path / "state.json").read_text())
    assert len(on_disk["faults"]) == 8 * 25
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_unwritable_state_dir_is_counted_logged_once_and_retried(tmp_path, capsys):
    from agent.logs import setup_logging

    setup_logging("json", "info")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # a file where the directory should be: fails for root too
    failures: list[str] = []
    s = LatchState(str(blocker / "state"), "b", on_write_failure=failures.append)
    assert s.load() == "new" and s.write_problem  # nothing there, and load()'s own write already fails
    assert s.latch(ev(seq=1), 100.0) is not None  # latched in memory all the same
    s.latch(ev(xid=48, seq=2), 101.0)
    assert s.write_failures == 3 and len(failures) == 3 and s.dirty
    assert "cannot write" in (s.write_problem or "")
    logged = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert sum("cannot be saved" in r["event"] for r in logged) == 1, "logged once per distinct problem"
    assert {f.xid for f in s.snapshot()} == {79, 48}
    blocker.unlink()
    assert s.retry() and not s.dirty and s.write_problem is None
    again = LatchState(str(blocker / "state"), "b")
    assert again.load() == "loaded" and {f.xid for f in again.snapshot()} == {79, 48}


def test_full_disk_write_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    import errno
    import os

    s = LatchState(str(tmp_path), "b")
    s.load()
    s.latch(ev(seq=1), 100.0)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert s.latch(ev(xid=48, seq=2), 101.0) is not None
    assert s.write_problem and "No space left" in s.write_problem
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # the temp file is removed
    assert [f["xid"] for f in json.loads((tmp_path / "state.json").read_text())["faults"]] == [79]
    monkeypatch.undo()
    assert s.retry()
    assert len(json.loads((tmp_path / "state.json").read_text())["faults"]) == 2


def test_rejected_clear_values_persist_for_the_boot(tmp_path):
    s = LatchState(str(tmp_path), "b")
    s.load()
    assert s.reject_clear("2099-01-01T00:00:00Z") and not s.reject_clear("2099-01-01T00:00:00Z")
    t = LatchState(str(tmp_path), "b")
    t.load()
    assert t.rejected_clears == {"2099-01-01T00:00:00Z"}
    t.new_boot("c")
    assert t.rejected_clears == set()


def test_event_aggregation_patches_only_series():
    """events.k8s.io/v1 Events are immutable except `series`: a patch of `note` is a 422."""

    class Api(RecordingApi):
        def patch_event(self, ns, name, patch):
            assert set(patch) == {"series"}, patch
            super().patch_event(ns, name, patch)

    now = [1000.0]
    api = Api()
    r = EventReporter(api, "n", interval_s=300, wall=lambda: now[0])  # type: ignore[arg-type]
    r.record("GPUsHealthy", "first")
    r.flush()
    r.record("GPUsHealthy", "second")
    r.flush()
    now[0] += 301
    r.flush()
    assert api.calls == [("create", "GPUsHealthy", "first"), ("patch", 2)]


def test_a_refused_event_is_dropped_not_retried():
    from agent.kube.client import ApiError

    class Refusing(RecordingApi):
        def create_event(self, ns, body):
            self.calls.append(("create", body["reason"]))
            raise ApiError(422, "Event is invalid")

    api, dropped = Refusing(), []
    r = EventReporter(api, "n", on_drop=lambda p, e: dropped.append((p.reason if p else None, e.status)))  # type: ignore[arg-type]
    r.record("GPUsHealthy", "x")
    r.record("FatalXid", "y", gpu="g")
    assert r.flush() == 0 and r.queue == [] and dropped == [("GPUsHealthy", 422), ("FatalXid", 422)]

    class Down(RecordingApi):
        def create_event(self, ns, body):
            raise ApiError(0, "connection refused")

    r = EventReporter(Down(), "n")  # type: ignore[arg-type]
    r.record("GPUsHealthy", "x")
    with pytest.raises(ApiError):
        r.flush()
    assert len(r.queue) == 1  # kept for the retry
