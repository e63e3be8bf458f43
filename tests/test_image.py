"""The runtime image holds no packaging tools (pip, setuptools, wheel: scanners flag them, the agent installs
nothing), and the release dry run states the image's size and package counts: tools/release/image_facts.py, which
tools/release/stage.sh runs inside the image, is checked here on environments made to have them or not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACTS = ROOT / "tools" / "release" / "image_facts.py"


def facts(python: Path) -> dict[str, object]:
    r = subprocess.run([str(python), str(FACTS), "--prefix"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_image_facts_finds_packaging_tools_and_counts(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "with")], check=True, timeout=300)
    got = facts(tmp_path / "with" / "bin" / "python")
    names = {Path(str(p)).name.split("-")[0] for p in got["packaging_tools"]}  # type: ignore[attr-defined]
    assert "pip" in names, got
    assert isinstance(got["bytes"], int) and got["bytes"] > 0 and got["python_packages"] >= 1
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=300)
    assert facts(tmp_path / "bare" / "bin" / "python")["packaging_tools"] == []


def test_the_image_removes_packaging_tools_and_the_release_summary_states_its_contents() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    runtime = dockerfile.split("COPY --from=build /opt/gpu-ready /opt/gpu-ready", 1)[1]
    for path in ("site-packages/pip ", "site-packages/setuptools ", "site-packages/wheel ", "ensurepip/_bundled",
                 "/usr/share/python-wheels"):  # fmt: skip
        assert path in runtime, path
    assert runtime.index("RUN rm -rf") < runtime.index("USER 65532")
    install = (ROOT / "docker" / "install.sh").read_text()
    assert "pip uninstall --yes --quiet --disable-pip-version-check setuptools wheel pip" in install
    stage = (ROOT / "tools" / "release" / "stage.sh").read_text()
    assert 'in_image - <"$repo/tools/release/image_facts.py"' in stage and 'echo "contents:   $image_line"' in stage
