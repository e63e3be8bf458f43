"""Probes on the simulated host and on plain data: PCI, device plugin, NVML (stand-in library), kmsg."""

from __future__ import annotations

import os

import pytest

from agent.kernel_log.source import KmsgSource, KmsgUnavailable, format_record
from agent.model import PciAddress, Reason, Severity
from agent.probes.device_plugin import MigCounts, plugin_counts, plugin_findings
from agent.probes.nvidia_smi import NvidiaSmiRunner, probe_nvidia_smi
from agent.probes.nvml import NvmlProbe
from agent.probes.pci import list_pci_gpus, probe_pci
from testkit.fakes import fake_nvml
from testkit.harness import wait_for

# -- PCI ------------------------------------------------------------------------------------------------


def test_pci_counts_only_gpus(simhost):
    # simhost has 8 GPUs plus 8 audio functions, 4 NVSwitches, USB, UCSI and a Mellanox NIC
    assert len(list_pci_gpus(str(simhost.sysfs))) == 8


def test_pci_excludes_virtual_functions_and_vfio(simhost):
    simhost.add_virtual_function(simhost.gpus[0].address, 0xE0)
    simhost.add_virtual_function(simhost.gpus[0].address, 0xE1)
    simhost.bind_vfio(simhost.gpus[7].address)
    simhost.add_pci_function(PciAddress(0, 0x70, 0), 0, 0x030000, 0x1F08)  # a VGA GPU counts
    gpus = list_pci_gpus(str(simhost.sysfs))
    assert len(gpus) == 8
    assert PciAddress(0, 0x70, 0) in {g.address for g in gpus}
    assert simhost.gpus[7].address not in {g.address for g in gpus}


def test_pci_scanner_reads_each_function_once_and_sees_every_change(simhost, monkeypatch):
    import shutil

    import agent.probes.pci as pci

    reads: list[str] = []
    real_read_hex = pci._read_hex
    monkeypatch.setattr(pci, "_read_hex", lambda path: reads.append(path) or real_read_hex(path))
    scanner = pci.PciScanner(str(simhost.sysfs))
    first = scanner.scan()
    assert len(first) == 8 and len(reads) > 8  # every function's vendor, the GPUs' class and device id
    key = scanner.key
    reads.clear()
    assert scanner.scan() == first and reads == [] and scanner.key == key  # steady: identities from the cache

    # A function removed and added again (a new inode) is read again; here it comes back as a NIC.
    gone = simhost.gpus[3].address
    entry = simhost.devices / simhost.sysfs_name(gone)
    shutil.rmtree(os.path.realpath(entry))
    if entry.is_symlink():
        entry.unlink()
    assert gone not in {g.address for g in scanner.scan()} and scanner.key != key
    simhost.add_pci_function(gone, 0, 0x020000, 0x1017, vendor=0x15B3, driver="mlx5_core")
    reads.clear()
    assert len(scanner.scan()) == 7 and any(simhost.sysfs_name(gone) in r for r in reads)
    # The driver binding is read on every scan: a GPU bound to vfio-pci leaves at once, and the key changes.
    key = scanner.key
    simhost.bind_vfio(simhost.gpus[7].address)
    assert simhost.gpus[7].address not in {g.address for g in scanner.scan()} and scanner.key != key


def test_pci_scanner_keeps_no_identity_it_could_not_read(simhost):
    from agent.probes.pci import PciScanner

    scanner = PciScanner(str(simhost.sysfs))
    vendor = simhost.devices / simhost.sysfs_name(simhost.gpus[5].address) / "vendor"
    vendor.unlink()
    vendor.mkdir()  # reading it fails (EISDIR), as an attribute of a function being removed can
    assert len(scanner.scan()) == 7
    vendor.rmdir()
    vendor.write_text("0x10de\n")
    assert len(scanner.scan()) == 8  # read again, not remembered as "not a GPU"


def test_pci_unreadable_root_is_unchecked(tmp_path):
    r = probe_pci(str(tmp_path / "nope"))
    assert not r.ran and r.count is None and r.findings[0].severity is Severity.UNCHECKED


# -- device plugin ----------------------------------------------------------------------------------


def node(cap, alloc=None, labels=None):
    return {
        "metadata": {"labels": labels or {}},
        "status": {"capacity": {"cpu": "8", **cap}, "allocatable": {"cpu": "8", **(alloc or cap)}},
    }


def test_plugin_none_strategy():
    pc = plugin_counts(node({"nvidia.com/gpu": "8"}), None)
    assert (pc.strategy, pc.physical, pc.total_capacity) == ("none", 8, 8)


def test_plugin_time_slicing_replicas_from_label_and_renamed_resource():
    pc = plugin_counts(node({"nvidia.com/gpu": "32"}, labels={"nvidia.com/gpu.replicas": "4"}), None)
    assert pc.physical == 8
    pc = plugin_counts(node({"nvidia.com/gpu.shared": "40"}, labels={"nvidia.com/gpu.shared.replicas": "10"}), None)
    assert pc.physical == 4
    pc = plugin_counts(node({"nvidia.com/gpu": "80"}), None, replicas=10)
    assert pc.physical == 8


def test_plugin_mig_single():
    lay = MigCounts(mig_enabled_gpus=8, gpus_with_mig_devices=8, mig_devices=56)
    pc = plugin_counts(node({"nvidia.com/gpu": "56"}, labels={"nvidia.com/mig.strategy": "single"}), lay)
    assert pc.physical == 8


def test_plugin_mig_mixed():
    lay = MigCounts(mig_enabled_gpus=2, gpus_with_mig_devices=2, mig_devices=8, full_gpus=6)
    pc = plugin_counts(node({"nvidia.com/gpu": "6", "nvidia.com/mig-1g.10gb": "4", "nvidia.com/mig-3g.40gb": "4"}), lay)
    assert (pc.strategy, pc.physical) == ("mixed", 8)
    # the plugin lost half the MIG devices: one MIG GPU is missing behind the plugin
    pc = plugin_counts(node({"nvidia.com/gpu": "6", "nvidia.com/mig-1g.10gb": "4"}), lay)
    assert pc.physical == 7


def test_plugin_unhealthy_and_not_serving():
    pc = plugin_counts(node({"nvidia.com/gpu": "8"}, {"nvidia.com/gpu": "7"}), None)
    f = plugin_findings(pc, True, 0)
    assert [x.kind for x in f] == ["unhealthy_devices"] and "nvidia.com/gpu 1 of 8" in f[0].message
    gone = plugin_counts(node({}), None)
    assert [x.kind for x in plugin_findings(gone, True, 0)] == ["not_serving"]
    assert [x.severity for x in plugin_findings(gone, False, 120)] == [Severity.UNCHECKED]
    zero = plugin_counts(node({"nvidia.com/gpu": "0"}), None)
    assert plugin_findings(zero, True, 0)[0].reason is Reason.DEVICE_PLUGIN_UNHEALTHY


# -- nvidia-smi runner --------------------------------------------------------------------------------


def test_missing_binary_is_could_not_check(tmp_path):
    r = probe_nvidia_smi(NvidiaSmiRunner(str(tmp_path / "missing"), 1))
    assert not r.ran and r.findings[0].severity is Severity.UNCHECKED and "not found" in r.findings[0].message


def test_hung_child_is_killed_at_the_timeout(simhost):
    """The stand-in hangs for an hour: the run returns because it was killed at the timeout, and the next run
    starts a fresh nvidia-smi (a hung one that could not be killed would be remembered and none started)."""
    simhost.set_smi(hang=True)
    r = NvidiaSmiRunner(str(simhost.nvidia_smi), timeout_s=0.5)
    res = probe_nvidia_smi(r)
    f = res.findings
    assert res.timed_out and f[0].kind == "timeout" and f[0].reason is Reason.NVIDIA_SMI_FAILED
    calls = simhost.smi_call_count()
    simhost.set_smi()
    assert probe_nvidia_smi(r).count == 8 and simhost.smi_call_count() == calls + 1


def test_unreapable_child_is_abandoned_and_no_second_one_starts(simhost, monkeypatch):
    """A D-state child survives SIGKILL; emulate that by making the agent's kills no-ops (nvidia-smi then
    sleeps on as a D-state one would)."""
    simhost.set_smi(hang=True, hang_seconds=60)
    r = NvidiaSmiRunner(str(simhost.nvidia_smi), timeout_s=0.5, reap_grace_s=0.3)
    monkeypatch.setattr(os, "kill", lambda *a: None)
    monkeypatch.setattr(os, "killpg", lambda *a: None)
    run = r.run()
    assert run.timed_out and run.hung_pid
    calls = simhost.smi_call_count()
    res = probe_nvidia_smi(r)
    assert [f.kind for f in res.findings] == ["hung"] and str(run.hung_pid) in res.findings[0].message
    assert not res.ran and simhost.smi_call_count() == calls, "no second nvidia-smi while the first lives"
    monkeypatch.undo()
    os.kill(run.hung_pid, 9)  # the D state ends: the next run reaps it and cleans up after it
    simhost.set_smi()
    res = wait_for(lambda: (x := probe_nvidia_smi(r)).ran and x, 20, what="a fresh nvidia-smi run")
    assert res.count == 8


# -- NVML with a stand-in library ------------------------------------------------------------------------


def test_nvml_faults_per_gpu():
    gpus = [
        {"busId": "00000000:19:00.0", "remap": (0, 0, 0, 0), "links": [1] * 18},
        {"busId": "00000000:3B:00.0", "recovery": 1},
        {"busId": "00000000:4C:00.0", "remap": (0, 4, 1, 0)},
        {"busId": "00000000:5D:00.0", "remap": (0, 4, 0, 1)},
        {"busId": "00000000:9B:00.0", "links": [1, 1, 1, 1]},
        {"busId": "00000000:BB:00.0", "handle_error": 15},
    ]
    probe = NvmlProbe("auto", nvml=fake_nvml(gpus))
    probe.sample()  # link 2 of 9B is seen up ...
    gpus[4]["links"] = [1, 1, 0, 1]  # ... and goes down
    f, snap = probe.sample()
    kinds = {(x.kind, x.gpu.nvml if x.gpu else None, x.severity.value) for x in f}
    assert kinds == {
        ("recovery_action", "00000000:3B:00.0", "fault"),
        ("row_remap_pending", "00000000:4C:00.0", "info"),
        ("row_remap_failure", "00000000:5D:00.0", "fault"),
        ("nvlink_down", "00000000:9B:00.0", "fault"),
        ("handle", None, "fault"),
    }
    assert "GPU index 5: NVML handle error: GPU is lost" in next(x.message for x in f if x.kind == "handle")
    assert snap.gpus[4].nvlink_down == [2]


def test_nvml_library_missing_is_skipped_in_auto_and_unchecked_when_required():
    f, snap = NvmlProbe("auto", nvml=fake_nvml([], init_error=12)).sample()
    assert snap is None and [x.severity for x in f] == [Severity.INFO]
    f, _ = NvmlProbe("on", nvml=fake_nvml([], init_error=12)).sample()
    assert [x.severity for x in f] == [Severity.UNCHECKED]
    assert NvmlProbe("off", nvml=fake_nvml([])).sample() == ([], None)


def test_nvml_call_under_a_deadline():
    p = NvmlProbe(
        "auto", deadline_s=0.3, nvml=fake_nvml([{"busId": "00000000:19:00.0"}], hang="nvmlDeviceGetRemappedRows")
    )
    f, _ = p.sample()  # returns although the call stays blocked until the test is over (testkit/fakes.py)
    assert f[0].reason is Reason.NVML_HEALTH and "did not return within 0.3s" in f[0].message
    f, _ = p.sample()  # the stuck call has not returned yet: no new call is started
    assert "still blocked" in f[0].message


def test_real_pynvml_without_a_driver_is_skipped():
    f, snap = NvmlProbe("auto").sample()  # nvidia-ml-py is installed; libnvidia-ml is not on CI machines
    if snap is None:
        assert f and f[0].kind == "skipped"


# -- kmsg reader --------------------------------------------------------------------------------------


def test_kmsg_file_reads_all_then_follows_and_drops_user_records(tmp_path):
    p = tmp_path / "kmsg"
    p.write_text(
        format_record("NVRM: Xid (PCI:0000:3b:00): 79, x", 1)
        + " SUBSYSTEM=pci\n DEVICE=+pci:0\n"
        + format_record("NVRM: Xid (PCI:0000:3b:00): 79, forged", 2, facility=1)
    )
    src = KmsgSource(str(p))
    recs, lost = src.read_available()
    assert [r.text for r in recs] == ["NVRM: Xid (PCI:0000:3b:00): 79, x"] and lost == 0
    with open(p, "a") as fh:
        fh.write(format_record("later", 3)[:5])  # a partial record: wait for its newline
    assert src.read_available()[0] == []
    with open(p, "a") as fh:
        fh.write(format_record("later", 3)[5:])
    assert [r.text for r in src.read_available()[0]] == ["later"]
    trusting = KmsgSource(str(p), trust_user=True)
    assert len(trusting.read_available()[0]) == 3


def test_kmsg_seq_gap_counts_lost_records(tmp_path):
    p = tmp_path / "kmsg"
    p.write_text(format_record("a", 10) + format_record("b", 11) + format_record("c", 500))
    src = KmsgSource(str(p))
    _, lost = src.read_available()
    assert lost == 488


def test_kmsg_escapes_are_decoded(tmp_path):
    p = tmp_path / "kmsg"
    p.write_text("3,1,5,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: fallen off the bus and is not responding\n")
    assert "\n" in KmsgSource(str(p)).read_available()[0][0].text


def test_kmsg_missing_file_raises_clear_error(tmp_path):
    with pytest.raises(KmsgUnavailable, match="cannot open kernel log"):
        KmsgSource(str(tmp_path / "none")).read_available()


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="needs a readable /dev/kmsg")
def test_real_dev_kmsg_is_read_as_records():
    src = KmsgSource("/dev/kmsg")
    recs, _ = src.read_available()
    src.close()
    assert src.is_device and src.records_read > 0
    assert all(r.facility == 0 for r in recs)
