"""A node that lost a GPU must pass preflight again, end to end with the real agent (`gpu-ready run` on a
simulated host) on the real apiserver with the chart's config, RBAC and admission policies and requirePreflight:
a fatal Xid latches, the agent labels its own Node gpu-ready.io/needs-preflight=true; a simulated reboot (new
boot id) clears the latch but the node stays False/PreflightNotPassed although it still carries its old
preflight=passed; only preflight's own write (with the preflight token, as the Job's record step makes it:
passed, the label removed) brings it back to True."""

from __future__ import annotations

import pytest

from agent.kube.client import KubeApi
from agent.preflight.onboarding import record_on_node
from agent.preflight.result import PASS, GateResult
from testkit.chart import Release, apply_release, by_kind
from testkit.cluster import bound_token, condition
from testkit.controlplane import ControlPlane
from testkit.harness import AgentProc, wait_for
from testkit.security import denied_by_policy
from testkit.simhost import SimHost

NEEDS = "gpu-ready.io/needs-preflight"
VALUES = ["--set", "config.requirePreflight=true", "--set", "preflight.enabled=true"]
TIMEOUT = 90.0


@pytest.fixture(scope="module")
def release(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Release:
    kc = control_plane.kubeconfig(tmp_path_factory.mktemp("kc") / "admin")
    return apply_release(control_plane, kc, "paf", VALUES)


def test_a_node_that_lost_a_gpu_must_pass_preflight_again(control_plane, admin, make_node, release, tmp_path):
    host = SimHost(tmp_path / "host", gpus=2)
    node = make_node(labels={"nvidia.com/gpu.present": "true", "preflight": "passed"}, capacity=host.plugin_resources())
    token, _ = bound_token(admin, release.ns, release.sa, node)
    # the policy is in force before the agent relies on it: another label is refused (dry run: nothing stored)
    probe = KubeApi.from_token(control_plane.host, token, control_plane.ca_file)
    assert wait_for(
        lambda: denied_by_policy(
            lambda: probe.request(
                "PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {"x": "y"}}}, "application/merge-patch+json",
                query={"dryRun": "All"},
            ),
            "own-node-only",
        ),
        60,
    )  # fmt: skip
    probe.close()
    config = tmp_path / "config.yaml"
    config.write_text(by_kind(release.docs, "ConfigMap")[release.fullname]["data"]["config.yaml"])
    agent = AgentProc(
        control_plane, host, node, token, extra={"--config": str(config), "--poll-interval": "2"}, workdir=tmp_path
    ).start()
    try:

        def cond() -> dict[str, str]:
            return condition(admin.get_node(node), "GPUReady") or {}

        assert wait_for(lambda: cond().get("status") == "True", TIMEOUT), agent.logs()[-2000:]
        host.append_xid(79, 1)
        assert wait_for(lambda: admin.get_node(node)["metadata"]["labels"].get(NEEDS) == "true", TIMEOUT)
        assert cond()["reason"] == "FatalXid"
        assert admin.get_node(node)["metadata"]["labels"]["preflight"] == "passed"  # the agent left it alone
        assert '"event": "labelled the Node"' in agent.logs()

        host.new_boot()  # the reboot clears the latch; the label stays
        assert wait_for(lambda: cond().get("reason") == "PreflightNotPassed", TIMEOUT), agent.logs()[-2000:]
        assert cond()["status"] == "False"
        calls = host.smi_call_count()
        assert wait_for(lambda: host.smi_call_count() >= calls + 2, TIMEOUT)  # cycles later: still held
        assert cond()["reason"] == "PreflightNotPassed"
        assert admin.get_node(node)["metadata"]["labels"].get(NEEDS) == "true"

        # preflight passes: its record step (with the preflight Job's token) sets passed and removes the label
        pf_token, _ = bound_token(admin, release.ns, f"{release.fullname}-preflight", node)
        pf = KubeApi.from_token(control_plane.host, pf_token, control_plane.ca_file)
        results = [GateResult("inventory", PASS, "ok")]
        record_on_node(pf, node, results, True, [], "preflight", NEEDS)
        pf.close()
        assert wait_for(lambda: cond().get("status") == "True", TIMEOUT), agent.logs()[-2000:]
        assert NEEDS not in admin.get_node(node)["metadata"]["labels"]
    finally:
        agent.terminate()
