"""Settings sections: each wing declares its settings once, as fields of one frozen dataclass, and the settings
table, Config, the probe registry, the controller's and preflight's flags derive from them."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import pytest

from agent import config
from agent.controller.settings import ControllerSettings
from agent.kernel_log.rate import XidRateThresholds
from agent.preflight.main import PreflightSettings
from agent.probes.clocks import ClockThresholds
from agent.probes.infiniband import FlapThresholds, IbThresholds, InfinibandSettings
from agent.probes.registry import REGISTRY, sections
from agent.settings import (
    RUN_ONLY,
    add_program_flags,
    in_range,
    rows,
    section_fields,
    setting,
    to_float,
    to_int,
)


def test_the_table_is_the_sections_rows_and_every_registry_row_names_one():
    assert rows(*config.SECTIONS) == config.SETTINGS
    assert len(config.BY_NAME) == len(config.SETTINGS)  # no two sections declare the same setting
    for spec in REGISTRY:
        assert spec.settings in config.SECTIONS and set(spec.also) <= set(config.SECTIONS), spec.check
    assert set(sections()) <= set(config.SECTIONS)
    for kind in config.SECTIONS:
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen, kind
        assert kind() == config.defaults()[kind], kind  # the section's defaults are the settings' defaults


def test_a_field_is_a_setting_with_a_derived_flag_environment_name_and_file_key():
    @dataclasses.dataclass(frozen=True)
    class Example:
        enabled: bool = setting(lambda v: v, True, "on", name="example")
        window_s: float = setting(in_range(to_float, 1, 60), 10.0, "seconds", name="example_window")
        poll_count: int = setting(to_int, 3, "polls", commands=RUN_ONLY, old_flags=("--example-polls",))
        kept: int = 1024  # not a setting: a bound the wing keeps in code

    (a, enabled), (b, window), (c, polls) = section_fields(Example)
    assert (a, b, c) == ("enabled", "window_s", "poll_count")
    assert (enabled.name, enabled.flag, enabled.env_name, enabled.file_key) == (
        "example",
        "--example",
        "GPU_READY_EXAMPLE",
        "example",
    )
    assert (window.flag, window.env_name, window.file_key, window.default) == (
        "--example-window",
        "GPU_READY_EXAMPLE_WINDOW",
        "exampleWindow",
        10.0,
    )
    assert (polls.name, polls.commands, polls.old_flags) == ("poll_count", RUN_ONLY, ("--example-polls",))


def test_a_wings_thresholds_are_its_section_read_by_type_or_by_setting_name():
    cfg = config.load(None, environ={"GPU_READY_XID_RATE_COUNT": "5", "GPU_READY_CLOCK_WINDOW": "120"})
    assert cfg[XidRateThresholds] == XidRateThresholds(count=5)
    assert cfg.xid_rate_count == 5 and cfg[ClockThresholds].window_s == 120.0 == cfg.clock_window
    assert cfg.core.poll_interval == cfg.poll_interval == 30.0
    with pytest.raises(AttributeError):
        _ = cfg.no_such_setting
    changed = cfg.with_values(fabric_manager_address=None, xid_rate_count=7)
    assert changed.xid_rate_count == 7 and changed.poll_interval == 30.0 and cfg.xid_rate_count == 5
    with pytest.raises(config.ConfigError, match="unknown setting 'pol_interval'"):
        cfg.with_values(pol_interval=1)


def test_infiniband_thresholds_take_their_defaults_from_the_section():
    assert InfinibandSettings().thresholds() == IbThresholds()
    assert FlapThresholds() == FlapThresholds(InfinibandSettings.ib_flap_count, InfinibandSettings.ib_flap_window)


def test_a_rule_across_a_sections_settings_is_one_config_error():
    # each value is in its own bounds; together the burst is not shorter than the window
    with pytest.raises(config.ConfigError, match=r"^invalid Xid rate: .*burst shorter than it"):
        config.defaults(xid_rate_window=1.0, xid_rate_burst=2.0)


def test_the_controllers_and_preflights_flags_derive_from_their_sections():
    for kind, required in ((ControllerSettings, ["--job-template=j.yaml"]), (PreflightSettings, ["--profile=p"])):
        p = argparse.ArgumentParser()
        add_program_flags(p, kind)
        args = vars(p.parse_args(required))
        for attr, s in section_fields(kind):
            if not s.required and s.env is None:
                assert args[attr] == s.default, attr
    p = argparse.ArgumentParser()
    add_program_flags(p, ControllerSettings)
    assert p.parse_args(["--job-template=j", "--max-concurrent=4", "--backoff=1.5"]).max_concurrent == 4


def test_the_agent_has_no_import_cycle_with_type_only_imports_counted():
    """config.py gathers every wing's section; no wing imports config.py back (not even for a type)."""
    import grimp

    graph = grimp.build_graph("agent", exclude_type_checking_imports=False)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        cycles = _cycles(graph)
    finally:
        sys.setrecursionlimit(limit)
    assert not cycles, cycles


def _cycles(graph: Any) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return out
