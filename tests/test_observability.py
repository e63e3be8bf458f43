"""Alert rules (real promtool), the dashboard, the metrics API, and a real Prometheus scraping the agent."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from testkit.controlplane import free_port, terminate_group
from testkit.harness import wait_for
from testkit.testbin import tool

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "gpu-ready.rules.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "gpu-ready-dashboard.json"
DOC_METRICS = ROOT / "docs" / "metrics.md"


def test_promtool_check_rules():
    r = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    n = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    assert n >= 6 and f"SUCCESS: {n} rules found" in r.stdout


def test_promtool_unit_tests_each_alert_fires_and_not():
    r = subprocess.run(
        [tool("promtool"), "test", "rules", "gpu-ready.rules.test.yaml"],
        capture_output=True,
        text=True,
        cwd=ROOT / "tests" / "prometheus",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    tests = yaml.safe_load((ROOT / "tests" / "prometheus" / "gpu-ready.rules.test.yaml").read_text())["tests"]
    for alert in (
        "GPUNodeNotReady",
        "GPUFatalXid",
        "GPUCountMismatch",
        "GPUReadyUnknown",
        "GPUReadyAgentDown",
        "NvidiaSmiHung",
        "GPUDegraded",
        "GPURecoveryFailed",
    ):
        cases = [c for t in tests for c in t["alert_rule_test"] if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in cases), f"{alert}: no firing case"
        assert any(not c["exp_alerts"] for c in cases) or alert == "GPUReadyAgentDown", f"{alert}: no silent case"


def test_every_alert_has_summary_description_runbook():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    for r in rules:
        a = r["annotations"]
        assert a["summary"] and "{{ $labels.node }}" in a["description"]
        anchor = a["runbook_url"].rsplit("#", 1)[1]
        assert f"## {r['alert']}" in runbooks and anchor == r["alert"].lower()


def exported_names() -> set[str]:
    from prometheus_client import generate_latest

    from agent.model import Counts, GpuStatus, Reason, Status, Verdict
    from agent.report.metrics import Metrics

    m = Metrics()
    m.publish(
        Verdict(
            Status.TRUE,
            Reason.GPUS_HEALTHY,
            "ok",
            (GpuStatus(0, "00000000:19:00.0", "H100", True),),
            (Reason.GPUS_HEALTHY,),
            Counts(8, 8, 8, 8, 8),
        ),
        0,
    )
    m.observe_xid_key((79, "0000:19:00", True))
    m.state_write_failures.inc(0)
    m.events_dropped.labels("422").inc()
    m.api_request("GET", 200)
    m.events.labels("FatalXid").inc()
    m.check_duration.labels("pci").observe(0.01)
    m.taints.observe(())  # gpu_ready_taint{effect}: set from the first Node read
    # the allocation map's series: published only with podResources on
    from agent.allocation import ContainerAllocation, PodRef, ResourceDevices, build_map
    from agent.model import PciAddress
    from testkit.allocation import inventory_from

    held = ContainerAllocation(PodRef("ns", "p", "c"), (ResourceDevices("nvidia.com/gpu", ("GPU-a",)),))
    inv = inventory_from([("GPU-a", PciAddress(0, 0x19, 0), 0, [])])
    whole = [ResourceDevices("nvidia.com/gpu", ("GPU-a",))]
    m.allocation.publish(build_map([held], whole, inv), enabled=True, read_seconds=0.01)
    text = generate_latest(m.registry).decode()
    from agent.controller.main import ControllerMetrics  # the controller's /metrics: its alerts use them

    cm = ControllerMetrics()
    cm.requests.labels("GET", "200").inc()
    text += generate_latest(cm.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_rules_dashboard_and_docs_use_only_exported_metrics():
    names = exported_names() | {"up"}
    used = set(re.findall(r"\b(gpu_ready_[a-z_]+)", RULES.read_text() + DASHBOARD.read_text()))
    assert used and used <= names, f"unknown metrics: {sorted(used - names)}"
    documented = set(re.findall(r"`(gpu_ready_[a-z_]+)", DOC_METRICS.read_text()))
    ours = {n for n in names if n.startswith("gpu_ready_")}
    base = {re.sub(r"_(bucket|sum|count)$", "", n) for n in ours}
    assert base <= documented | {n + "_total" for n in documented}, f"undocumented: {sorted(base - documented)}"


def test_dashboard_has_the_panels():
    d = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in d["panels"] for t in p["targets"])
    for metric in (
        "gpu_ready_status",
        "gpu_ready_gpu_healthy",
        "gpu_ready_xid_total",
        "gpu_ready_gpus",
        "gpu_ready_check_duration_seconds_bucket",
    ):
        assert metric in exprs


def test_pci_bus_id_has_one_form_on_every_metric():
    from prometheus_client import generate_latest

    from agent.model import Counts, GpuStatus, PciAddress, Reason, Status, Verdict
    from agent.report.metrics import Metrics, bus_id_label

    for raw in ("0000:3b:00", "0000:3b:00.0", "00000000:3B:00.0", "PCI:0000:3b:00"):
        assert bus_id_label(raw) == PciAddress(0, 0x3B, 0).nvml == "00000000:3B:00.0"
    m = Metrics()
    m.observe_xid_key((79, "0000:3b:00", True))
    gpu = GpuStatus(1, "00000000:3B:00.0", "H100", False, ("FatalXid: Xid 79",))
    m.publish(Verdict(Status.FALSE, Reason.FATAL_XID, "x", (gpu,), (Reason.FATAL_XID,), Counts()), 1)
    text = generate_latest(m.registry).decode()
    forms = set(re.findall(r'pci_bus_id="([^"]*)"', text))
    assert forms == {"00000000:3B:00.0"}, forms


def test_label_values_are_bounded():
    from prometheus_client import generate_latest

    from agent.model import Check, Counts, Finding, GpuIdentity, Observation, PciAddress, Reason
    from agent.report.metrics import Metrics
    from agent.verdict import decide

    m = Metrics()
    a = PciAddress(0, 0x19, 0)
    long = "x" * 500
    v = decide(
        Observation(
            [Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, long, a)],
            {a: GpuIdentity(a, 0, "H100")},
            Counts(1, 1),
        )
    )
    m.publish(v, 0)
    assert long not in generate_latest(m.registry).decode()


# -- a real Prometheus scraping a real agent ----------------------------------------------------------


def prom_query(base: str, q: str) -> list[dict]:
    with urllib.request.urlopen(f"{base}/api/v1/query?query={urllib.parse.quote(q)}", timeout=5) as r:
        return json.loads(r.read())["data"]["result"]


def prom_alerts(base: str) -> list[dict]:
    with urllib.request.urlopen(f"{base}/api/v1/alerts", timeout=5) as r:
        return json.loads(r.read())["data"]["alerts"]


@pytest.mark.apiserver
def test_real_prometheus_scrape_and_fatal_xid_alert(agent_factory, admin, simhost, tmp_path):
    a = agent_factory()
    a.wait_status(admin, "True")
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
                "rule_files": [str(RULES)],
                "scrape_configs": [
                    {
                        "job_name": "gpu-ready",
                        "static_configs": [{"targets": [f"127.0.0.1:{a.port}"], "labels": {"node": a.node}}],
                    }
                ],
            }
        )
    )
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115
    prom = subprocess.Popen(
        [
            tool("prometheus"),
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: prom_query(base, 'gpu_ready_status{status="True"} == 1'), 30, 0.3, "first scrape")
        series = prom_query(base, 'scrape_samples_scraped{job="gpu-ready"}')[0]["value"][1]
        duration = float(prom_query(base, 'scrape_duration_seconds{job="gpu-ready"}')[0]["value"][1])
        simhost.append_xid(79, 3)
        a.wait_status(admin, "False", "FatalXid")
        got = wait_for(lambda: prom_query(base, 'gpu_ready_xid_total{fatal="true",xid="79"}'), 20, 0.3, "xid metric")
        assert got[0]["metric"]["pci_bus_id"] == "00000000:5D:00.0" and got[0]["metric"]["node"] == a.node
        # One pci_bus_id form on every metric: the unhealthy GPU joins its Xid counter in PromQL.
        joined = wait_for(
            lambda: prom_query(
                base,
                'gpu_ready_xid_total{fatal="true"} * on(node, pci_bus_id) group_left(gpu) (gpu_ready_gpu_healthy == 0)',
            ),
            20,
            0.3,
            "gpu_ready_xid_total joined with gpu_ready_gpu_healthy on pci_bus_id",
        )
        assert [(j["metric"]["gpu"], j["metric"]["pci_bus_id"], j["metric"]["xid"]) for j in joined] == [
            ("3", "00000000:5D:00.0", "79")
        ]
        healthy_join = prom_query(base, "gpu_ready_gpu_healthy and on(pci_bus_id) gpu_ready_xid_total")
        assert [j["metric"]["gpu"] for j in healthy_join] == ["3"]
        assert wait_for(lambda: prom_query(base, 'gpu_ready_status{status="False",reason="FatalXid"} == 1'), 20, 0.3)
        alert = wait_for(
            lambda: [x for x in prom_alerts(base) if x["labels"]["alertname"] == "GPUFatalXid"],
            30,
            0.3,
            "GPUFatalXid alert",
        )
        assert alert[0]["state"] in ("pending", "firing")
        assert alert[0]["labels"]["node"] == a.node and alert[0]["labels"]["xid"] == "79"
        unhealthy = prom_query(base, "gpu_ready_gpu_healthy == 0")
        assert [s["metric"]["gpu"] for s in unhealthy] == ["3"]
        series_after = prom_query(base, 'scrape_samples_scraped{job="gpu-ready"}')[0]["value"][1]
        print(
            f"\n[scrape] 8-GPU node: {series} series healthy, {series_after} with one fatal Xid; "
            f"scrape duration {duration * 1000:.1f} ms"
        )
    finally:
        terminate_group(prom)
        log.close()
    assert prom.returncode is not None


def test_openmetrics_negotiation_and_health_codes():
    import urllib.error

    from agent.http import HealthServer
    from agent.report.metrics import Metrics

    state = {"healthy": (True, "ok"), "ready": (False, "first check cycle not completed")}
    srv = HealthServer("127.0.0.1:0", Metrics().registry, lambda: state["healthy"], lambda: state["ready"]).start()
    base = f"http://127.0.0.1:{srv.port}"
    try:
        req = urllib.request.Request(f"{base}/metrics", headers={"Accept": "application/openmetrics-text"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert r.read().decode().rstrip().endswith("# EOF")
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(f"{base}/readyz", timeout=5)
        assert ei.value.code == 503
        state["healthy"] = (False, "no check cycle completed for 95s (limit 90s)")
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(f"{base}/healthz", timeout=5)
        assert ei.value.code == 503 and b"no check cycle" in ei.value.read()
    finally:
        srv.stop()


def test_agent_health_turns_503_when_the_loop_stalls(simhost):
    import time as _time

    from agent import config
    from agent.kube.client import KubeApi
    from agent.runner import Agent

    cfg = config.load(
        None,
        environ={},
        overrides={
            "node_name": "n",
            "poll_interval": 10,
            "nvidia_smi_timeout": 5,
            "state_dir": str(simhost.state_dir),
            "kmsg": str(simhost.kmsg),
        },
    )
    agent = Agent(cfg, api=KubeApi.from_token("https://127.0.0.1:1", "t"))
    assert agent.healthy()[0] and not agent.ready()[0]
    agent.cycles, agent.last_cycle_mono = 1, _time.monotonic() - 36  # 3 intervals + the smi timeout = 35 s
    ok, why = agent.healthy()
    assert not ok and "no check cycle completed" in why
    assert agent.ready()[0]


def test_per_gpu_and_count_series_follow_the_verdict_and_are_set_only_on_a_change(monkeypatch):
    from prometheus_client import generate_latest

    from agent.model import Counts, GpuStatus, Reason, Status, Verdict
    from agent.report.metrics import Metrics

    m = Metrics()

    def verdict(healthy: list[bool | None], counts: Counts) -> Verdict:
        rows = tuple(GpuStatus(i, f"00000000:{0x19 + i:02X}:00.0", "H100", h) for i, h in enumerate(healthy))
        return Verdict(Status.TRUE, Reason.GPUS_HEALTHY, "ok", rows, (Reason.GPUS_HEALTHY,), counts)

    def series() -> dict[str, float]:
        text = generate_latest(m.registry).decode()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("gpu_ready_gpu_healthy{", "gpu_ready_gpus{"))
        }

    m.publish(verdict([True, True], Counts(2, 2, 2, 2, 2)), 0)
    first = series()
    assert first['gpu_ready_gpu_healthy{gpu="1",name="H100",pci_bus_id="00000000:1A:00.0"}'] == 1
    assert first['gpu_ready_gpus{source="nvidia_smi"}'] == 2
    sets: list[tuple[str, ...]] = []
    real_labels = type(m.gpu_healthy).labels
    monkeypatch.setattr(type(m.gpu_healthy), "labels", lambda self, *a: sets.append(a) or real_labels(self, *a))
    m.publish(verdict([True, True], Counts(2, 2, 2, 2, 2)), 0)
    assert sets == [] and series() == first  # unchanged: no series touched
    m.publish(verdict([True, False], Counts(2, 1, None, 2, 2)), 0)
    now = series()
    assert now['gpu_ready_gpu_healthy{gpu="1",name="H100",pci_bus_id="00000000:1A:00.0"}'] == 0
    assert now['gpu_ready_gpus{source="nvidia_smi"}'] == 1 and 'gpu_ready_gpus{source="pci"}' in now
    assert not any("plugin_capacity" in k for k in now)  # a source that went away is removed
    assert len(sets) == 2  # the changed GPU and the changed count
    m.publish(verdict([True, None], Counts(2, 1, 2, 2, 2)), 0)
    now = series()
    assert not any('gpu="1"' in k for k in now)  # not checked: absent, never a stale 0 or 1
    assert now['gpu_ready_gpus{source="plugin_capacity"}'] == 2
