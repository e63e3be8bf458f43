"""A node bundle on disk: what `gpu-ready capture` writes and `gpu-ready check --replay` reads (docs/agent.md,
"Capture and replay").

A bundle is a directory or a `.tar.gz` of one: `bundle.json` (format, configuration, the agent's settings, what was
captured), the raw command outputs under their fixed names (`nvidia-smi.txt`, `nvidia-smi-q.txt`, ...), and, from
`capture`, the exact readings the probes made (`nvml.json`, `runs.json`, a `sys/` tree, `proc/`, `dev.json`,
`kmsg.txt`). Reading one is bounded and refuses anything hostile with one line (BundleError): more than MAX_MEMBERS
entries or MAX_TOTAL bytes unpacked, a member over MAX_FILE, a compressed file over MAX_ARCHIVE, an absolute path or
`..`, a link that is not a relative symbolic link inside `sys/` or `proc/` resolving there, a device, FIFO or hard
link. A bundle is read whole into memory and never extracted by tarfile: what a replay writes to disk is written by
`materialize`, file by file, under a fresh directory."""

from __future__ import annotations

import errno
import io
import json
import os
import posixpath
import stat
import tarfile
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

FORMAT = "gpu-ready-bundle/1"
MAX_MEMBERS = 50_000
MAX_TOTAL = 96 << 20  # bytes unpacked
MAX_FILE = 32 << 20  # bytes of one member
MAX_ARCHIVE = 64 << 20  # bytes of a .tar.gz
MAX_PATH = 512
MAX_DEPTH = 40
LINK_TREES = ("sys", "proc")  # the only places a bundle may hold symbolic links (sysfs is made of them)


class BundleError(ValueError):
    """A bundle that cannot be read: one line, no traceback (exit 2)."""


@dataclass
class Bundle:
    """A bundle read into memory: regular files and symbolic links by relative path."""

    source: str
    files: dict[str, bytes] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)

    @property
    def meta(self) -> dict[str, Any]:
        raw = self.files.get("bundle.json")
        if raw is None:
            return {}
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise BundleError(f"bundle.json is not JSON: {str(e)[:100]}") from None
        if not isinstance(data, dict):
            raise BundleError("bundle.json is not an object")
        return data

    def text(self, name: str) -> str | None:
        raw = self.files.get(name)
        return None if raw is None else raw.decode("utf-8", "replace")

    def json(self, name: str) -> Any:
        raw = self.text(name)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise BundleError(f"{name} is not JSON: {str(e)[:100]}") from None

    def has_tree(self, prefix: str) -> bool:
        p = prefix.rstrip("/") + "/"
        return any(k.startswith(p) for k in (*self.files, *self.links, *self.dirs))


def clean_path(name: str) -> str:
    """A member's path, normalised; BundleError for an absolute path, `..`, a NUL or an over-long one."""
    if "\0" in name or len(name) > MAX_PATH:
        raise BundleError(f"bad member name {name[:80]!r}")
    if name.startswith("/") or name.startswith("\\"):
        raise BundleError(f"absolute path in bundle: {name[:80]!r}")
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise BundleError(f"path leaves the bundle: {name[:80]!r}")
    if len(parts) > MAX_DEPTH:
        raise BundleError(f"path too deep: {name[:80]!r}")
    return "/".join(parts)


def check_link(path: str, target: str) -> str:
    """A symbolic link may live only in sys/ or proc/, be relative and resolve inside that tree."""
    top = path.split("/", 1)[0]
    if top not in LINK_TREES:
        raise BundleError(f"symbolic link outside sys/ and proc/: {path[:80]!r}")
    if not target or target.startswith("/") or "\0" in target or len(target) > MAX_PATH:
        raise BundleError(f"symbolic link {path[:80]!r} points outside the bundle")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    if resolved != top and not resolved.startswith(top + "/"):
        raise BundleError(f"symbolic link {path[:80]!r} points outside {top}/")
    return target


class _Budget:
    def __init__(self) -> None:
        self.members = 0
        self.total = 0

    def take(self, name: str, size: int) -> None:
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise BundleError(f"more than {MAX_MEMBERS} entries")
        if size > MAX_FILE:
            raise BundleError(f"member {name[:80]!r} is larger than {MAX_FILE >> 20} MiB")
        self.total += size
        if self.total > MAX_TOTAL:
            raise BundleError(f"more than {MAX_TOTAL >> 20} MiB unpacked")


def load(path: str) -> Bundle:
    """A bundle directory or .tar.gz (.tgz, .tar) read whole; BundleError (one line) for anything else."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise BundleError(f"cannot read {path}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        b = _load_dir(path)
    elif stat.S_ISREG(st.st_mode):
        b = _load_tar(path, st.st_size)
    else:
        raise BundleError(f"{path} is neither a directory nor a file")
    b = _strip_top(b)
    _no_path_through_links(b)
    if not b.files:
        raise BundleError(f"{path} holds no files")
    if "bundle.json" not in b.files:
        raise BundleError(f"{path} has no bundle.json")
    fmt = b.meta.get("format")
    if fmt != FORMAT:
        raise BundleError(f"bundle.json: format {str(fmt)[:40]!r}, expected {FORMAT!r}")
    return b


def _strip_top(b: Bundle) -> Bundle:
    """A tar of the bundle's directory (`name/bundle.json`): its one top-level folder taken away."""
    if "bundle.json" in b.files:
        return b
    tops = {k.split("/", 1)[0] for k in (*b.files, *b.links, *b.dirs)}
    if len(tops) != 1:
        return b
    top = tops.pop() + "/"
    if top + "bundle.json" not in b.files:
        return b
    cut = len(top)
    out = Bundle(b.source)
    out.files = {k[cut:]: v for k, v in b.files.items() if k.startswith(top)}
    out.dirs = {k[cut:] for k in b.dirs if k.startswith(top)}
    for k, v in b.links.items():
        if k.startswith(top):
            out.links[k[cut:]] = check_link(k[cut:], v)
    return out


def _no_path_through_links(b: Bundle) -> None:
    """No member lies below a symbolic link (writing it would follow the link)."""
    if not b.links:
        return
    for name in (*b.files, *b.links, *b.dirs):
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in b.links:
                raise BundleError(f"{name[:80]!r} lies below a symbolic link")


def _load_dir(root: str) -> Bundle:
    b = Bundle(root)
    budget = _Budget()
    for rel, kind in _walk(root, budget):
        full = os.path.join(root, rel)
        if kind == "dir":
            b.dirs.add(rel)
        elif kind == "link":
            b.links[rel] = check_link(rel, os.readlink(full))
        else:
            b.files[rel] = _read_regular(full, rel)
    return b


def _walk(root: str, budget: _Budget) -> Iterator[tuple[str, str]]:
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(os.path.join(root, rel) if rel else root) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            raise BundleError(f"cannot list {rel or root}: {e.strerror}") from None
        for entry in entries:
            name = clean_path(f"{rel}/{entry.name}" if rel else entry.name)
            if entry.is_symlink():
                budget.take(name, 0)
                yield name, "link"
            elif entry.is_dir(follow_symlinks=False):
                budget.take(name, 0)
                yield name, "dir"
                stack.append(name)
            elif entry.is_file(follow_symlinks=False):
                budget.take(name, entry.stat(follow_symlinks=False).st_size)
                yield name, "file"
            else:
                raise BundleError(f"{name[:80]!r} is not a regular file, folder or link")


def _read_regular(path: str, rel: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise BundleError(f"cannot read {rel[:80]!r}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BundleError(f"{rel[:80]!r} is not a regular file")
        chunks: list[bytes] = []
        n = 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            n += len(chunk)
            if n > MAX_FILE:
                raise BundleError(f"member {rel[:80]!r} is larger than {MAX_FILE >> 20} MiB")
            chunks.append(chunk)
    finally:
        os.close(fd)


def _load_tar(path: str, size: int) -> Bundle:
    if size > MAX_ARCHIVE:
        raise BundleError(f"{path} is larger than {MAX_ARCHIVE >> 20} MiB")
    b = Bundle(path)
    budget = _Budget()
    try:
        with tarfile.open(path, mode="r:*") as tf:
            while True:
                m = tf.next()
                if m is None:
                    break
                name = clean_path(m.name)
                if not name:
                    continue
                budget.take(name, m.size if m.isfile() else 0)
                if m.isdir():
                    b.dirs.add(name)
                elif m.issym():
                    b.links[name] = check_link(name, m.linkname)
                elif m.isfile():
                    fh = tf.extractfile(m)
                    data = fh.read(MAX_FILE + 1) if fh is not None else b""
                    if len(data) != m.size:
                        raise BundleError(f"member {name[:80]!r} is truncated")
                    b.files[name] = data
                else:
                    raise BundleError(f"{name[:80]!r} is not a regular file, folder or symbolic link")
    except BundleError:
        raise
    except (tarfile.TarError, EOFError, zlib.error, OSError, UnicodeDecodeError) as e:
        why = " ".join(str(e).split())[:120] or type(e).__name__
        raise BundleError(f"{path} is not a readable bundle archive: {why}") from None
    return b


def materialize(b: Bundle, prefix: str, dest: str) -> bool:
    """Writes the bundle's `prefix/` tree (files, folders, the checked links) under `dest`; False when it has none."""
    p = prefix + "/"
    wrote = False
    for d in sorted(x for x in b.dirs if x.startswith(p) or x == prefix):
        os.makedirs(os.path.join(dest, d), exist_ok=True)
        wrote = True
    for name, data in b.files.items():
        if name.startswith(p):
            full = os.path.join(dest, name)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as fh:
                fh.write(data)
            wrote = True
    for name, target in sorted(b.links.items()):
        if name.startswith(p):
            full = os.path.join(dest, name)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            try:
                os.symlink(target, full)
            except OSError as e:
                if e.errno != errno.EEXIST:
                    raise
            wrote = True
    top = os.path.realpath(os.path.join(dest, prefix))
    for name in b.links:  # links that each stay inside may still leave together: resolve them as the probes will
        if name.startswith(p):
            real = os.path.realpath(os.path.join(dest, name))
            if real != top and not real.startswith(top + os.sep):
                raise BundleError(f"symbolic link {name[:80]!r} resolves outside {prefix}/")
    return wrote


def write(files: Mapping[str, bytes], links: Mapping[str, str], dest: str) -> str:
    """Writes a bundle as a directory, or as a .tar.gz when `dest` ends so; returns `dest`."""
    if dest.endswith((".tar.gz", ".tgz")):
        with tarfile.open(dest, "w:gz") as tf:
            seen: set[str] = set()

            def folder(path: str) -> None:
                parts = path.split("/")[:-1]
                for i in range(1, len(parts) + 1):
                    d = "/".join(parts[:i])
                    if d not in seen:
                        seen.add(d)
                        ti = tarfile.TarInfo(d)
                        ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                        tf.addfile(ti)

            for name in sorted(files):
                folder(name)
                ti = tarfile.TarInfo(name)
                ti.size, ti.mode = len(files[name]), 0o644
                tf.addfile(ti, io.BytesIO(files[name]))
            for name in sorted(links):
                folder(name)
                ti = tarfile.TarInfo(name)
                ti.type, ti.linkname = tarfile.SYMTYPE, links[name]
                tf.addfile(ti)
        return dest
    os.makedirs(dest, exist_ok=True)
    for name in sorted(files):
        full = os.path.join(dest, name)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as fh:
            fh.write(files[name])
    for name in sorted(links):
        full = os.path.join(dest, name)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        if not os.path.lexists(full):
            os.symlink(links[name], full)
    return dest
