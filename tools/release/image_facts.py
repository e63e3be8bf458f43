"""What an image holds, from inside it (run with the image's own Python; standard library only): its size (the
bytes of its regular files, each hard link once), its file count, its Debian and Python package counts, and any
packaging tool left in the runtime environment (pip, setuptools, wheel: installed, or as the wheels that ensurepip
or Debian's python3-venv keep), which scanners flag and the agent never runs.

    python image_facts.py            # the whole filesystem (in the image)
    python image_facts.py --prefix   # only this interpreter's environment (sys.prefix: a venv under test)

Prints one JSON object."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

TOOLS = ("pip", "setuptools", "wheel")
SKIP = {"/proc", "/sys", "/dev", "/run", "/tmp"}
DIST = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-[^/]*\.(dist-info|egg-info|whl)$")


def tools_in(path: Path) -> list[str]:
    """Installed distributions (dist-info, egg-info) and wheel files of pip, setuptools or wheel in `path`."""
    found = []
    try:
        entries = sorted(os.listdir(path))
    except OSError:
        return found
    for e in entries:
        m = DIST.match(e)
        if (m and m.group("name").lower().replace("_", "-") in TOOLS) or (
            e in TOOLS and (path / e / "__init__.py").exists()
        ):
            found.append(str(path / e))
    return found


def places(prefix_only: bool) -> list[Path]:
    if prefix_only:
        return [Path(p) for p in sys.path if p and Path(p).is_dir() and p.startswith(sys.prefix)]
    out = [Path(p) for p in sys.path if p and Path(p).is_dir()]
    for base in ("/usr/share/python-wheels", "/usr/lib/python3/dist-packages"):
        out.append(Path(base))
    for root in ("/usr/lib", "/usr/local/lib"):
        out += sorted(Path(root).glob("python3*/ensurepip/_bundled"))
        out += sorted(Path(root).glob("python3*/site-packages"))
    return list(dict.fromkeys(out))


def size(root: str) -> tuple[int, int]:
    seen: set[tuple[int, int]] = set()
    total = files = 0
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if os.path.join(d, x) not in SKIP]
        for n in names:
            try:
                st = os.lstat(os.path.join(d, n))
            except OSError:
                continue
            if st.st_mode & 0o170000 != 0o100000 or (st.st_dev, st.st_ino) in seen:  # regular files only
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
            files += 1
    return total, files


def main() -> int:
    prefix_only = "--prefix" in sys.argv[1:]
    status = Path("/var/lib/dpkg/status")
    debian = status.read_text(errors="replace").count("\nStatus: install ok installed") if status.exists() else 0
    python = sorted(
        {
            m.group("name").lower()
            for p in places(True)
            for e in (os.listdir(p) if p.is_dir() else [])
            if (m := DIST.match(e)) and e.endswith(".dist-info")
        }
    )
    total, files = size(sys.prefix if prefix_only else "/")
    found = sorted({f for p in places(prefix_only) for f in tools_in(p)})
    print(json.dumps({"bytes": total, "files": files, "debian_packages": debian, "python_packages": len(python),
                      "packaging_tools": found}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
