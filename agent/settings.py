"""The vocabulary of settings: the `setting` field of a settings section, the `Setting` row it makes, and the
converters.

Every setting is declared once, as a field of its wing's section: a frozen dataclass beside the code that uses it
(a probe's, the kernel log's, an action's, the agent's own core section in config.py), whose fields are made with
`setting(converter, default, help)`. The rows (`rows`, `section_fields`) derive from the fields, and flags,
environment names, file keys, the chart schema's check and the configuration doc derive from the rows. The
converters (`to_float`, `to_int`, `to_bool`, ...) are public so that other inputs (the preflight profile) validate
the same way: `convert(conv, value, what)` raises ConfigError naming `what`."""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import re
import reprlib
import stat
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any, Protocol, TypeVar

import yaml

DAY = 86_400.0
INT_LIMIT = 10**18  # integers have at most 18 digits (a flag, a file or a profile): no huge-int arithmetic
FLOAT_LIMIT = 1e18  # numbers too: every real setting is far below; time.sleep(1e300) is an OverflowError
MAX_NESTING = 64  # lists and mappings inside each other in a file we parse; real ones use 2 to 6

T = TypeVar("T")


class ConfigError(ValueError):
    pass


# -- converters: value from a flag/env (str) or a file (YAML scalar/list) -> typed value, or ValueError ---


def _scalar(v: Any, expected: str) -> Any:
    """`v` unless it is a list, mapping or set: those are refused before str() (a YAML alias bomb is tiny as a
    file and billions of items as a string)."""
    if isinstance(v, dict | list | tuple | set | frozenset | bytes):
        raise ValueError(f"expected {expected}, got {_show(v)}")
    return v


def to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(_scalar(v, "true or false")).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {_show(v)}")


def to_int(v: Any) -> int:
    """An integer of at most 18 digits: 8, "8" and 8.0 are 8; 8.5, "8.5", true, 10**400 (a YAML integer) and
    5000-digit strings are errors."""
    if isinstance(v, bool):
        raise ValueError(f"expected an integer, got {_show(v)}")
    if isinstance(v, int | float):
        if isinstance(v, float) and (not math.isfinite(v) or v != int(v)):
            raise ValueError(f"expected an integer, got {_show(v)}")
        if not -INT_LIMIT < v < INT_LIMIT:
            raise ValueError(f"expected an integer of at most 18 digits, got {_show(v)}")
        return int(v)
    s = str(_scalar(v, "an integer")).strip()
    if not re.fullmatch(r"[+-]?\d{1,18}", s):
        raise ValueError(f"expected an integer, got {_show(v)}")
    return int(s)


def to_float(v: Any) -> float:
    """A finite number from -1e18 to 1e18: nan and inf are errors (a nan poll interval busy-loops; inf never
    wakes), and so is 10**400 (a YAML integer float() cannot take)."""
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got {_show(v)}")
    if isinstance(v, int) and not -INT_LIMIT < v < INT_LIMIT:
        raise ValueError(f"expected a number from -1e18 to 1e18, got {_show(v)}")
    try:
        x = float(v) if isinstance(v, int | float) else float(str(_scalar(v, "a number")).strip()[:64])
    except (ValueError, OverflowError):
        raise ValueError(f"expected a number, got {_show(v)}") from None
    if not math.isfinite(x):
        raise ValueError(f"expected a finite number, got {_show(v)}")
    if not -FLOAT_LIMIT <= x <= FLOAT_LIMIT:
        raise ValueError(f"expected a number from -1e18 to 1e18, got {_show(v)}")
    return x


def to_str(v: Any) -> str:
    if isinstance(v, dict | list | bool) or v is None:
        raise ValueError(f"expected a string, got {_show(v)}")
    s = str(v)
    if not s or len(s) > 4096 or "\x00" in s:
        raise ValueError(f"expected a non-empty string, got {_show(v)}")
    return s


def to_int_list(v: Any) -> tuple[int, ...]:
    if isinstance(v, list | tuple):
        items = v
    else:
        items = [x for x in str(_scalar(v, "a list of integers")).replace(" ", ",").split(",") if x]
    if len(items) > 1024:
        raise ValueError(f"at most 1024 entries, got {len(items)}")
    out = tuple(to_int(x) for x in items)
    for x in out:
        if not 0 <= x < 2**31:
            raise ValueError(f"expected numbers from 0 to {2**31 - 1}, got {x}")
    return out


def optional(conv: Callable[[Any], T]) -> Callable[[Any], T | None]:
    def check(v: Any) -> T | None:
        return None if v is None or (isinstance(v, str) and v.strip() in ("", "null")) else conv(v)

    return check


def choice(*options: str) -> Callable[[Any], str]:
    def conv(v: Any) -> str:
        s = str(_scalar(v, f"one of {', '.join(options)}")).strip().lower()
        if s not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {_show(v)}")
        return s

    return conv


def choice_exact(*options: str) -> Callable[[Any], str]:
    """One of `options`, spelled as given (API enums such as NoSchedule); any other case is named in the error."""

    def conv(v: Any) -> str:
        s = str(v).strip() if isinstance(v, str) else v
        if s not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {_show(v)}")
        return str(s)

    return conv


def in_range(
    conv: Callable[[Any], Any], low: float | None = None, high: float | None = None, *, above: bool = False
) -> Callable[[Any], Any]:
    """Wraps a numeric converter with bounds: `low` inclusive (exclusive when `above`), `high` inclusive."""

    def check(v: Any) -> Any:
        x = conv(v)
        if x is None:
            return x
        if low is not None and (x <= low if above else x < low):
            raise ValueError(f"must be {'greater than' if above else 'at least'} {low:g}, got {_number(x)}")
        if high is not None and x > high:
            raise ValueError(f"must be at most {high:g}, got {_number(x)}")
        return x

    return check


def positive(conv: Callable[[Any], Any], high: float | None = None) -> Callable[[Any], Any]:
    return in_range(conv, 0, high, above=True)


def non_negative(conv: Callable[[Any], Any], high: float | None = None) -> Callable[[Any], Any]:
    return in_range(conv, 0, high)


_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9.]{0,251}[A-Za-z0-9])?")


def dns_subdomain(v: Any) -> str:
    s = to_str(v)
    if not _DNS_SUBDOMAIN.fullmatch(s):
        raise ValueError(f"expected a DNS subdomain name (lowercase letters, digits, '-', '.'), got {_show(v)}")
    return s


def absolute_path(v: Any) -> str:
    s = to_str(v)
    if not s.startswith("/"):
        raise ValueError(f"expected an absolute path, got {_show(v)}")
    return s


def label_key(v: Any) -> str:
    s = to_str(v)
    prefix, _, name = s.rpartition("/")
    if (prefix and not _DNS_SUBDOMAIN.fullmatch(prefix)) or not _LABEL_NAME.fullmatch(name):
        raise ValueError(f"expected a label key ([prefix/]name), got {_show(v)}")
    return s


_QUALIFIED_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def qualified_name(v: Any) -> str:
    """A Kubernetes qualified name, `[prefix/]name`: the prefix a DNS subdomain (at most 253), the name at
    most 63 letters, digits, '-', '_', '.' starting and ending alphanumeric. Taint keys and condition types
    such as `gpu-ready.io/gpu-not-ready` or `nvidia.com/GPUReady`."""
    s = to_str(v)
    prefix, slash, name = s.rpartition("/")
    if (
        len(s) > 317
        or len(prefix) > 253
        or not _LABEL_NAME.fullmatch(name)
        or (slash and not _QUALIFIED_PREFIX.fullmatch(prefix))
    ):
        raise ValueError(f"expected a qualified name ([prefix/]name, e.g. example.com/Name), got {_show(v)}")
    return s


def host_port(v: Any) -> str:
    """`host:port`, `:port` or `[v6]:port` with a port from 0 to 65535."""
    s = to_str(v).strip()
    host, sep, port = s.rpartition(":")
    if not sep or not re.fullmatch(r"\d{1,5}", port) or int(port) > 65535:
        raise ValueError(f"expected host:port with a port from 0 to 65535, got {_show(v)}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare:
        try:
            ipaddress.ip_address(bare)
        except ValueError:
            if not _HOSTNAME.fullmatch(bare):
                raise ValueError(f"expected host:port, got {_show(v)}") from None
    return s


def readable_file(v: Any) -> str:
    s = to_str(v)
    if not os.path.isfile(s):
        raise ValueError(f"no such file: {_show(v)}")
    if not os.access(s, os.R_OK):
        raise ValueError(f"cannot read {_show(v)}")
    return s


def share(v: Any) -> float:
    """A fraction from 0 (inclusive) to 1 (exclusive)."""
    x = to_float(v)
    if not 0 <= x < 1:
        raise ValueError(f"expected a fraction from 0 up to (not including) 1, got {x:g}")
    return x


def metrics_url(v: Any) -> str:
    """An exporter's metrics address: `http(s)://host:port/path`, or `host:port` for `http://host:port/metrics`."""
    s = to_str(v).strip()
    if "://" not in s:
        if host_port(s).startswith(":"):
            raise ValueError(f"expected host:port with a host, got {_show(v)}")
        return f"http://{s}/metrics"
    scheme, _, rest = s.partition("://")
    hostport, slash, _path = rest.partition("/")
    if scheme not in ("http", "https") or not hostport or any(c in s for c in " \t\r\n"):
        raise ValueError(f"expected http://host:port/metrics or host:port, got {_show(v)}")
    if ":" in hostport.rpartition("]")[2]:
        host_port(hostport)
    elif not _HOSTNAME.fullmatch(hostport.strip("[]")):
        raise ValueError(f"expected http://host:port/metrics or host:port, got {_show(v)}")
    return s if slash else s + "/metrics"


class _ShortRepr(reprlib.Repr):
    """repr() cut to a few items, levels and characters, in time bounded by those (not by the value's size: a
    YAML alias bomb is billions of items); an integer too long for repr() is shown by its length."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, 60, 60, 60
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 6

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 200:
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1} digits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()


def _show(v: Any) -> str:
    r = _SHORT.repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _number(x: Any) -> str:
    try:
        return f"{x:g}"
    except (TypeError, ValueError, OverflowError):
        return _show(x)


# -- reading the files we parse (a settings file, a preflight profile, a results file) ------------------


def read_text_file(path: str, limit: int) -> str:
    """A regular file's UTF-8 text, at most `limit` bytes. Never blocks: a FIFO, a device, a directory or a
    /dev/stdin-style path is refused before a byte is read, and a file over `limit` before it is read.
    OSError when it cannot be opened or read; ValueError (one line) when it is not a small text file."""
    _refuse_special(os.stat(path).st_mode)  # before open(): opening a device or a FIFO can have effects
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)  # what was opened (the path may have been replaced since the stat)
        _refuse_special(st.st_mode)
        if st.st_size > limit:
            raise ValueError(f"larger than {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise ValueError(f"larger than {limit} bytes")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start})") from None


def _refuse_special(mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
        raise ValueError(f"not a regular file ({kind})")


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
)
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where installed: ~5x faster


def _too_deep() -> ValueError:
    return ValueError(f"nested deeper than {MAX_NESTING} levels of lists and mappings")


def load_yaml(text: str) -> Any:
    """yaml.safe_load for a document nested at most MAX_NESTING levels. The depth is counted on the parser's
    event stream first (linear time, no recursion, nothing built), so a deep document is one ValueError, never
    a RecursionError. yaml.YAMLError when it is not YAML; ValueError for the depth or a value no constructor
    takes (a 5000-digit integer, 2024-13-01)."""
    loader = _YAML_LOADER(text)
    try:
        depth = 0
        while not isinstance(event := loader.get_event(), yaml.StreamEndEvent | None):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_NESTING:
                    raise _too_deep()
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as e:
        if "maximum nesting depth" in str(e):  # libyaml's own limit (1000) met while scanning ahead
            raise _too_deep() from None
        raise
    finally:
        loader.dispose()
    try:
        return yaml.load(text, Loader=_YAML_LOADER)  # a safe loader: CSafeLoader or SafeLoader
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"a value cannot be read: {_first_line(e)}") from None


def load_json(text: str) -> Any:
    """json.loads for a document nested at most MAX_NESTING levels; ValueError (one line) otherwise."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:
        raise ValueError(f"not valid JSON: {_first_line(e)}") from None
    stack = [(data, 1)]
    while stack:  # iterative: the depth of what json built, in time linear in its size
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > MAX_NESTING:
                raise _too_deep()
            stack += [(x, depth + 1) for x in (node.values() if isinstance(node, dict) else node)]
    return data


def _first_line(e: BaseException) -> str:
    return ((str(e).splitlines() or [type(e).__name__])[0] or type(e).__name__)[:160]


def convert(conv: Callable[[Any], T], value: Any, what: str) -> T:
    """Runs a converter; a bad value raises ConfigError naming `what` (for inputs other than settings)."""
    try:
        return conv(value)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"invalid {what}: {e}") from None


# The subcommands a setting is a flag of. The environment and the settings file set every setting for every
# command (the chart's file is read by `run` and by a `check` in the same pod); the flags of a command are only
# the settings that change what it does.
CHECK, GPUS, RUN = "check", "gpus", "run"
EVERY_COMMAND = (CHECK, GPUS, RUN)  # what changes a one-shot verdict: the probes, their thresholds, the Xid catalog
WITH_NODE = (CHECK, RUN)  # only where the Node is read: `check --node` and `run` (`gpus` never reads it)
RUN_ONLY = (RUN,)  # the loop and what only the agent writes: poll, heartbeat, watch, spread, state, Events, ...


@dataclass(frozen=True)
class Setting:
    name: str  # python attribute; flag --name-with-dashes; env GPU_READY_NAME; file key camelCase
    conv: Callable[[Any], Any]
    default: Any
    help: str
    env: str | None = None  # extra env name (e.g. NODE_NAME), read after GPU_READY_<NAME>
    # False: a test seam, not a setting: only its environment variable sets it (no flag, no file key, not in the
    # chart's schema or the configuration doc)
    public: bool = True
    commands: tuple[str, ...] = EVERY_COMMAND  # the subcommands that take it as a flag
    flag_name: str | None = None  # the flag when it is not the name (`--node` for node_name)
    old_flags: tuple[str, ...] = ()  # earlier spellings of the flag: still accepted, not shown in --help
    # A program's flag outside the agent's settings (add_program_flags): it must be given / one of these values
    required: bool = False
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + (self.flag_name or self.name).replace("_", "-")

    @property
    def boolean(self) -> bool:
        """A true/false setting: its flag is `--x` / `--no-x` (and `--x=<bool>`)."""
        return self.conv is to_bool

    @property
    def env_name(self) -> str:
        return "GPU_READY_" + self.name.upper()

    @property
    def file_key(self) -> str:
        head, *rest = self.name.split("_")
        return head + "".join(w.capitalize() for w in rest)


_ROW_FIELDS = ("conv", "default", "help", "env", "public", "commands", "flag_name", "old_flags", "required", "choices")


# -- sections: each wing's settings as one frozen dataclass ------------------------------------------------------

_ROW = "gpu_ready_setting"  # the dataclass field metadata key that makes a field a setting


def setting(
    conv: Callable[[Any], Any],
    default: Any,
    help: str,
    *,
    name: str | None = None,
    env: str | None = None,
    public: bool = True,
    commands: tuple[str, ...] = EVERY_COMMAND,
    flag_name: str | None = None,
    old_flags: tuple[str, ...] = (),
    required: bool = False,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A field of a settings section that is a setting: its default, converter and help, and (when the field's
    name is not the setting's) the setting's name, from which the flag, environment name and file key derive.
    A section's other fields (bounds kept in code, values the wing fills in itself) are not settings."""
    row = Setting(name or "", conv, default, help, env, public, commands, flag_name, old_flags, required, choices)
    return field(default=default, metadata={_ROW: row})


def section_fields(section: type) -> tuple[tuple[str, Setting], ...]:
    """(field name, Setting) for each field of a section that is a setting, in the section's order."""
    out = []
    for f in fields(section):
        row: Setting | None = f.metadata.get(_ROW)
        if row is not None:
            out.append((f.name, _named(row, f)))
    return tuple(out)


def _named(row: Setting, f: Field[Any]) -> Setting:
    return row if row.name else Setting(f.name, *(getattr(row, k) for k in _ROW_FIELDS))


def rows(*sections: type) -> tuple[Setting, ...]:
    """The Setting rows of some sections, in order."""
    return tuple(s for section in sections for _, s in section_fields(section))


def add_program_flags(parser: argparse.ArgumentParser, section: type) -> None:
    """The flags of a program beside the agent (the controller, preflight), one per setting of its section. Such a
    flag has no environment name or file key of its own: argparse converts it with the row's converter (`int`,
    `float`: argparse's own message and exit 2), its default is the row's extra environment variable when that is
    set (POD_NAMESPACE), else the row's default; a true/false one is a plain switch; a test seam (not public) is
    left out of --help. The destination is the field's name."""
    for attr, s in section_fields(section):
        kw: dict[str, Any] = {"dest": attr, "help": s.help if s.public else argparse.SUPPRESS}
        if s.conv is to_bool:
            kw["action"] = "store_true"
        else:
            kw["default"] = (os.environ.get(s.env) if s.env else None) or s.default
            kw.update({"type": s.conv} if s.conv is not str else {})
            kw.update({"required": True} if s.required else {})
            kw.update({"choices": s.choices} if s.choices else {})
        parser.add_argument(s.flag, **kw)


S = TypeVar("S")


class Sections(Protocol):
    """The settings by section: `cfg[XidRateThresholds]` is that section (what a probe's builder is handed)."""

    def __getitem__(self, kind: type[S]) -> S: ...


# -- names the chart's admission policies exempt for gpu-ready's token: never someone else's ------------------

# Kubelet's own Node conditions: the policy lets the agent's token write only its condition type.
KUBELET_CONDITIONS = frozenset({"Ready", "MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable"})
# Taint keys of others the agent's DaemonSet tolerates or that other controllers own.
FOREIGN_TAINTS = frozenset(
    {"nvidia.com/gpu", "CriticalAddonsOnly", "ToBeDeletedByClusterAutoscaler", "DeletionCandidateOfClusterAutoscaler"}
)
# Labels of others that preflight's label must not be: GPU feature discovery's, which the DaemonSet selects on.
FOREIGN_LABELS = frozenset({"nvidia.com/gpu.present"})
# Prefixes under kubernetes.io and k8s.io that are made for taint keys of one's own: Cluster Autoscaler's startup,
# status and ignore taints (docs/taints.md: a node joins with startup-taint.cluster-autoscaler.kubernetes.io/<name>)
# and the Node Readiness Controller's readiness.k8s.io/<name> (the taint a NodeReadinessRule manages).
OWN_TAINT_PREFIXES = (
    *(f"{kind}-taint.cluster-autoscaler.kubernetes.io/" for kind in ("startup", "status", "ignore")),
    "readiness.k8s.io/",
)


def reserved_prefix(name: str) -> str | None:
    """The Kubernetes-reserved prefix of a qualified name (`kubernetes.io/`, `k8s.io/` or a subdomain of either,
    e.g. node.kubernetes.io/, node-role.kubernetes.io/), or None."""
    prefix, slash, _ = name.rpartition("/")
    if slash and any(prefix == d or prefix.endswith("." + d) for d in ("kubernetes.io", "k8s.io")):
        return prefix + "/"
    return None


def _not_foreign(
    conv: Callable[[Any], str], what: str, foreign: frozenset[str], own_prefixes: tuple[str, ...] = ()
) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        s = conv(v)
        if s in foreign:
            raise ValueError(
                f"{s!r} is not gpu-ready's to use as {what}: the admission policy would give it to the token"
            )
        reserved = reserved_prefix(s)
        if reserved and not s.startswith(own_prefixes):
            raise ValueError(f"{s!r} is under {reserved}, reserved for Kubernetes: not allowed as {what}")
        return s

    return check


# The converters of conditionType, taintKey and preflightLabel (and preflight's --needs-label): the chart refuses the
# same names (templates/_helpers.tpl gpu-ready.validateNames).
own_condition_type = _not_foreign(qualified_name, "the condition type", KUBELET_CONDITIONS)
own_taint_key = _not_foreign(qualified_name, "the taint key", FOREIGN_TAINTS, OWN_TAINT_PREFIXES)
own_label_key = _not_foreign(label_key, "preflight's label", FOREIGN_LABELS)
