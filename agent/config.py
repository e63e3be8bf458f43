"""One typed, frozen settings object from flags, environment and a config file (the chart's ConfigMap).

Precedence: command-line flag > environment variable (GPU_READY_<NAME>, then an extra name such as
NODE_NAME) > config file > default. `Config` is the set of sections (SECTIONS): the agent's own (CoreSettings,
here), each probe's as the registry's rows name them (agent/probes/registry.py) and each action's. Each setting is
one field of one section (agent/settings.py `setting`); SETTINGS, the flags, env names, file keys and the docs
table derive from the fields. Every value goes through its converter here, in one place: a bad value raises
ConfigError naming the setting and where it came from, and the CLI exits 2 with that one line.

The converters (`to_float`, `to_int`, `to_bool`, ...) are public so that other inputs (the preflight
profile) validate the same way: `convert(conv, value, what)` raises ConfigError naming `what`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import yaml

from agent.act import brake, preflight_mark
from agent.act.fencing import plan as fencing
from agent.act.recovery.ladder import RecoverySection
from agent.act.taints import plan as taints
from agent.names import CONDITION_TYPE
from agent.probes import registry
from agent.settings import (
    DAY,
    RUN_ONLY,
    WITH_NODE,
    ConfigError,
    Setting,
    _show,
    choice,
    convert,
    dns_subdomain,
    host_port,
    in_range,
    non_negative,
    optional,
    own_condition_type,
    own_label_key,
    positive,
    readable_file,
    rows,
    section_fields,
    setting,
    to_bool,
    to_float,
    to_int,
    to_str,
)

DEFAULT_METRICS_ADDRESS = "0.0.0.0:9465"  # not dcgm-exporter's 9400 nor node-exporter's 9100
CONFIG_FILE_LIMIT = 64 << 10  # bytes; a settings file is a few hundred (every setting, 1024-entry lists: <20 KiB)


# The agent's own settings; each probe and action declares its section beside it, gathered below.
@dataclass(frozen=True)
class CoreSettings:
    """The agent's own settings: the node, the loop, the state, Events, the API and logs."""

    # `check --node` reads that Node and sets it
    node_name: str | None = setting(
        optional(dns_subdomain),
        None,
        "Node to report on",
        env="NODE_NAME",
        commands=RUN_ONLY,
        flag_name="node",
        old_flags=("--node-name",),
    )
    poll_interval: float = setting(positive(to_float, DAY), 30.0, "seconds between check cycles", commands=RUN_ONLY)
    heartbeat_interval: float = setting(
        positive(to_float, DAY), 300.0, "seconds between condition heartbeats", commands=RUN_ONLY
    )
    node_watch: bool = setting(
        to_bool, True, "read the own Node from a watch (off: GET resourceVersion=0 each poll)", commands=RUN_ONLY
    )
    node_watch_timeout: float = setting(
        positive(to_float, DAY), 600.0, "each Node watch lasts 1 to 2 times this, seconds", commands=RUN_ONLY
    )
    start_spread: float = setting(
        non_negative(to_float, 3600),
        60.0,
        "hold the first condition write after start a random 0..this many seconds (unless the status changes)",
        commands=RUN_ONLY,
    )
    heartbeat_jitter: float = setting(
        in_range(to_float, 0, 1), 0.2, "each heartbeat waits interval x (1 +- jitter/2)", commands=RUN_ONLY
    )
    recovery_polls: int = setting(
        in_range(to_int, 1, 1000), 2, "clean polls before a level fault clears", commands=RUN_ONLY
    )
    expected_gpus: int | None = setting(
        optional(non_negative(to_int, 4096)), None, "GPUs this node must have (unset: no floor)"
    )
    state_dir: str = setting(
        to_str, "/var/lib/gpu-ready", "directory for latched faults (a hostPath)", commands=RUN_ONLY
    )
    boot_id_file: str = setting(
        to_str, "/proc/sys/kernel/random/boot_id", "file holding the boot ID", commands=RUN_ONLY
    )
    event_interval: float = setting(
        non_negative(to_float, DAY), 300.0, "at most one Event per reason and GPU per this many s", commands=RUN_ONLY
    )
    event_namespace: str = setting(
        choice("default", "kube-system"),
        "default",
        "namespace of the agent's Events about its Node (the apiserver accepts Events about a cluster-scoped "
        "object only in default or kube-system)",
        commands=RUN_ONLY,
    )
    metrics_address: str = setting(
        host_port, DEFAULT_METRICS_ADDRESS, "host:port for /metrics, /healthz, /readyz", commands=RUN_ONLY
    )
    require_preflight: bool = setting(
        to_bool, False, "report True only on nodes labelled <preflight-label>=passed", commands=RUN_ONLY
    )
    preflight_label: str = setting(
        own_label_key, "preflight", "label key set by gpu-ready preflight", commands=RUN_ONLY
    )
    condition_type: str = setting(
        own_condition_type,
        CONDITION_TYPE,
        "Node condition type the agent writes (e.g. nvidia.com/GPUReady); must equal the chart's conditionType",
        commands=WITH_NODE,
    )
    kubeconfig: str | None = setting(
        optional(readable_file), None, "kubeconfig file (default: in-cluster, then ~/.kube/config)", commands=WITH_NODE
    )
    api_timeout: float = setting(
        positive(to_float, 600), 10.0, "timeout for one API request, seconds", commands=WITH_NODE
    )
    log_format: str = setting(choice("auto", "json", "console"), "auto", "auto: JSON unless stderr is a terminal")
    log_level: str = setting(choice("debug", "info", "warning", "error"), "info", "log level")


# Every section: the agent's own, each probe's (the registry's rows name them), then each action's.
ACTION_SECTIONS: tuple[type, ...] = (
    fencing.FencingSection,
    taints.TaintSection,
    RecoverySection,
    preflight_mark.PreflightMarkSection,
    brake.BrakeSection,
)
SECTIONS: tuple[type, ...] = (CoreSettings, *registry.sections(), *ACTION_SECTIONS)
SETTINGS: tuple[Setting, ...] = rows(*SECTIONS)
BY_NAME = {s.name: s for s in SETTINGS}
_INDEX = {kind: i for i, kind in enumerate(SECTIONS)}
_WHERE = {s.name: (i, attr) for i, kind in enumerate(SECTIONS) for attr, s in section_fields(kind)}
S = TypeVar("S")


@dataclass(frozen=True)
class Config:
    """Every setting, typed, by section: `cfg[XidRateThresholds]` is that wing's section, in SECTIONS' order.
    A setting is also read by its own name (`cfg.poll_interval`, `cfg.xid_rate_count`), from its section. Build
    it with load()."""

    sections: tuple[Any, ...]

    def __getitem__(self, kind: type[S]) -> S:
        section: S = self.sections[_INDEX[kind]]
        return section

    def __getattr__(self, name: str) -> Any:
        where = _WHERE.get(name)
        if where is None:
            raise AttributeError(f"no setting {name!r}")
        return getattr(self.sections[where[0]], where[1])

    @property
    def core(self) -> CoreSettings:
        return self[CoreSettings]

    def with_values(self, **values: Any) -> Config:
        """A copy with some settings (by name) replaced, as they are (no converter runs)."""
        changes: dict[int, dict[str, Any]] = {}
        for name, v in values.items():
            if name not in _WHERE:
                raise ConfigError(f"unknown setting {name!r}")
            i, attr = _WHERE[name]
            changes.setdefault(i, {})[attr] = v
        return Config(tuple(replace(s, **changes[i]) if i in changes else s for i, s in enumerate(self.sections)))

    @property
    def marks_after_fault(self) -> bool:
        """preflightAfterFault, which follows requirePreflight when unset."""
        return self.require_preflight if self.preflight_after_fault is None else self.preflight_after_fault

    @property
    def retry_cap_s(self) -> float:
        """The longest wait between retries of a write or a read (condition, taint, Events, the Node): one poll,
        at most 30 s."""
        return min(30.0, self.poll_interval)

    @property
    def error_pause_s(self) -> float:
        """After an unexpected error in the loop, the next cycle comes this soon (a poll, at most 5 s)."""
        return min(self.poll_interval, 5.0)

    @property
    def stall_limit_s(self) -> float:
        """No completed cycle for this long: /healthz fails (three polls and one nvidia-smi timeout)."""
        return 3 * self.poll_interval + self.nvidia_smi_timeout


DOC_BEGIN = "<!-- the settings table: made from SETTINGS by `make docs`; a test checks it -->"
DOC_END = "<!-- end of the settings table -->"


def settings_table() -> str:
    """docs/configuration.md's table, from the rows: every public setting in SETTINGS' order."""

    def shown(v: Any) -> str:
        return repr(list(v) if isinstance(v, tuple) else v)

    out = ["| flag | environment | file key | default | flag of | meaning |", "|---|---|---|---|---|---|"]
    for s in SETTINGS:
        if s.public:
            env = f"`{s.env_name}`" + (f" or `{s.env}`" if s.env else "")
            on = ", ".join(s.commands)
            out.append(f"| `{s.flag}` | {env} | `{s.file_key}` | `{shown(s.default)}` | {on} | {s.help} |")
    return "\n".join(out)


def write_settings_table(path: str) -> bool:
    """Writes the table between DOC_BEGIN and DOC_END in `path`; True when the file changed."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    head, _, rest = text.partition(DOC_BEGIN + "\n")
    _, _, tail = rest.partition(DOC_END)
    new = f"{head}{DOC_BEGIN}\n{settings_table()}\n{DOC_END}{tail}"
    if new != text:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(new)
    return new != text


class BoolFlag(argparse.Action):
    """A true/false setting's flag: `--x` is true, `--no-x` false, and the older `--x=<bool>` / `--x <bool>`
    still work (that value goes through the setting's converter in load(), as every flag's does)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        negative = ["--no-" + o[2:] for o in option_strings]
        super().__init__([*option_strings, *negative], dest, nargs="?", metavar="BOOL", **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: Any = None
    ) -> None:
        if isinstance(option_string, str) and option_string.startswith("--no-"):
            if values is not None:
                raise argparse.ArgumentError(self, f"{option_string} takes no value")
            values = False
        setattr(namespace, self.dest, True if values is None else values)


class HelpFormatter(argparse.HelpFormatter):
    """--help shows a true/false flag as `--x, --no-x`, and a description or epilog keeps its paragraphs (blank
    lines; each is wrapped as usual)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text
        return "\n\n".join(fill(p, width, indent) for p in text.split("\n\n"))

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, BoolFlag):
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)


def flags_of(command: str) -> tuple[Setting, ...]:
    """The settings `command` takes as flags (every setting is read from the environment and the file)."""
    return tuple(s for s in SETTINGS if s.public and command in s.commands)


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """`--config` and, in a group of their own, a flag for each setting of `command` (Setting.commands); a
    true/false one is `--x/--no-x`."""
    parser.add_argument(
        "--config",
        help="YAML or JSON settings file: any setting, keys in camelCase, e.g. pollInterval (default: "
        "$GPU_READY_CONFIG)",
    )
    group = parser.add_argument_group(
        "settings", "each also from the environment or the settings file: flag > environment > file > default"
    )
    for s in flags_of(command):
        env = f"; env {s.env_name}" + (f" or {s.env}" if s.env else "")
        text = f"{s.help} (default: {s.default!r}{env})".replace("%", "%%")  # argparse %-formats help
        kind: dict[str, Any] = {"action": BoolFlag} if s.boolean else {"metavar": s.flag[2:].replace("-", "_").upper()}
        group.add_argument(s.flag, dest=s.name, default=None, help=text, **kind)
        if s.old_flags:
            group.add_argument(*s.old_flags, dest=s.name, default=None, help=argparse.SUPPRESS, **kind)


def _read_file(path: str) -> dict[str, Any]:
    """The settings file: a regular file (a FIFO or /dev/stdin is refused, never waited on) of at most
    CONFIG_FILE_LIMIT bytes (refused before it is read), nested at most settings.MAX_NESTING levels (refused
    before anything is built). Anything else is one ConfigError line."""
    from agent.settings import load_json, load_yaml, read_text_file

    try:
        text = read_text_file(path, CONFIG_FILE_LIMIT)
        data = load_json(text) if path.endswith(".json") else load_yaml(text)
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: not valid YAML{yaml_where(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def yaml_where(e: yaml.YAMLError) -> str:
    """` at line L, column C: <problem>` of a YAML error (1-based, as an editor shows them), else `: <first line>`."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
    if mark is None:
        return f": {problem}"
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}"


def did_you_mean(key: str, keys: Mapping[str, Setting]) -> str:
    """One spelling of a settings-file key, camelCase (as the chart's values and docs/configuration.md write them):
    a snake_case key is refused with its camelCase form; any other unknown key gets the closest known one."""
    import difflib

    camel = next((s.file_key for s in keys.values() if s.name == key), None)
    if camel is not None:
        return f": keys are camelCase, write {camel}"
    norm = key.replace("_", "").replace("-", "").lower()
    close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.6) or [k for k in keys if k.lower() == norm][:1]
    return f" (did you mean {close[0]}?)" if close else ""


def load(
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Flags (args), environment, file, defaults -> Config. Raises ConfigError naming the setting."""
    environ = os.environ if environ is None else environ
    raw: dict[str, tuple[Any, str]] = {}
    path = getattr(args, "config", None) if args is not None else None
    path = path or environ.get("GPU_READY_CONFIG")
    if path:
        keys = {s.file_key: s for s in SETTINGS if s.public}
        for k, v in _read_file(path).items():
            s = keys.get(str(k))
            if s is None:
                raise ConfigError(f"config file {path}: unknown setting {_show(k)}{did_you_mean(str(k), keys)}")
            raw[s.name] = (v, f"{s.file_key} in {path}")
    for s in SETTINGS:
        for env in (s.env_name, s.env):
            if env and environ.get(env) not in (None, ""):
                raw[s.name] = (environ[env], f"environment variable {env}")
                break
        if args is not None and getattr(args, s.name, None) is not None:
            raw[s.name] = (getattr(args, s.name), s.flag)
    for k, v in (overrides or {}).items():
        if k not in BY_NAME:
            raise ConfigError(f"unknown setting {k!r}")
        raw[k] = (v, k)
    values: dict[str, Any] = {}
    for s in SETTINGS:
        if s.name in raw:
            v, where = raw[s.name]
            values[s.name] = convert(s.conv, v, f"{s.name.replace('_', '-')} ({where})")
        else:
            values[s.name] = s.default
    both = set(values["xid_fatal"]) & set(values["xid_ignore"])
    if both:
        raise ConfigError(f"invalid xid-fatal/xid-ignore: Xids {sorted(both)} are in both lists")
    return Config(tuple(_section(kind, values) for kind in SECTIONS))


def _section(kind: type[S], values: Mapping[str, Any]) -> S:
    """One section from the converted values; a rule across its settings that fails is one ConfigError."""
    try:
        return kind(**{attr: values[s.name] for attr, s in section_fields(kind)})
    except ValueError as e:
        raise ConfigError(f"invalid {e}") from None


def defaults(**overrides: Any) -> Config:
    """The defaults (no flags, no environment, no file) with some settings replaced, validated."""
    return load(None, environ={}, overrides=overrides)


assert len(BY_NAME) == len(SETTINGS), "two sections declare the same setting"
