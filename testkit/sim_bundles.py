"""The bundles in tests/fixtures/bundles/: `gpu-ready capture` run on the simulated node (testkit/simhost.py) with
the NVML stand-in (testkit/fakes.py), committed (as .tar.gz) so that a bundle written by this version keeps loading
and replaying to the verdict it recorded in later versions (tests/test_capture_replay.py). `python -m
testkit.sim_bundles` writes them again (the node's temporary paths are taken out of the recorded settings)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from agent import capture as capture_mod
from agent import cli
from agent.bundle import load
from agent.bundle import write as write_bundle
from testkit.fakes import fake_nvml
from testkit.simhost import SimHost

ROOT = Path(__file__).resolve().parent.parent
BUNDLES = ROOT / "tests" / "fixtures" / "bundles"
PATHS = ("sysfsRoot", "devRoot", "procRoot", "kmsg", "nvidiaSmi", "imexCtl")


def sim_xid79_remap_failure(host: SimHost) -> list[dict[str, Any]]:
    """8 H100s below their own root ports with 4 rails beside them; ERR! in GPU 1's fan, Xid 79 on GPU 5, a row
    remap failure on GPU 2 in NVML, every NVLink up."""
    for i in range(4):
        host.add_rail(f"mlx5_{i}", gpu=i * 2)
    host.make_dev_nodes(mig=True)
    host.set_smi(err={1: ("Fan",)})
    host.append_xid(79, gpu=5)
    gpus = [{"busId": g.address.nvml, "remap": (0, 0, False, False), "links": [1] * 18} for g in host.gpus]
    gpus[2]["remap"] = (0, 2, False, True)
    return gpus


SCENARIOS = {"sim-h100x8-xid79-err-remap-failure": sim_xid79_remap_failure}


def write(name: str, dest: Path) -> Path:
    with tempfile.TemporaryDirectory() as d:
        host = SimHost(Path(d) / "host", pcie_bridges=True)
        lib = fake_nvml(SCENARIOS[name](host))
        saved = capture_mod._pynvml
        capture_mod._pynvml = lambda: lib
        try:
            args = [a for a in host.check_args() if a not in ("--nvml", "off")]
            rc = cli.main(["capture", "-q", "-o", str(Path(d) / name), *args])
        finally:
            capture_mod._pynvml = saved
        if rc != 0:
            raise RuntimeError(f"capture of {name} failed ({rc})")
        meta_path = Path(d) / name / "bundle.json"
        meta = json.loads(meta_path.read_text())
        meta["settings"] = {k: v for k, v in meta["settings"].items() if k not in PATHS}
        what = (SCENARIOS[name].__doc__ or name).split(";")[0].strip()
        meta["config"] = f"simulated: {what} (testkit/sim_bundles.py)"
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        b = load(str(Path(d) / name))
        out = dest / f"{name}.tar.gz"
        out.unlink(missing_ok=True)
        write_bundle(b.files, b.links, str(out))
    return out


if __name__ == "__main__":
    for n in SCENARIOS:
        print(write(n, BUNDLES), file=sys.stderr)
