"""The command line as a kubectl user meets it: -o json|yaml|wide on `check` and `gpus` (--json kept), exit 2 for
every usage or configuration error (an unknown Node included), settings-file errors with the line and column or
the closest known key, one key spelling (camelCase), the top help naming every command, and `controller`,
`preflight` and `uninstall` help giving every flag's meaning and default."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import cli
from agent import config as config_mod


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def settings_file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "settings.yaml"
    p.write_text(text)
    return p


def error_of(path: Path) -> str:
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(None, environ={"GPU_READY_CONFIG": str(path)})
    return str(e.value)


def test_yaml_error_names_line_and_column(tmp_path: Path) -> None:
    p = settings_file(tmp_path, "pollInterval: 30\nexpectedGpus: [8\nxidFatal: []\n")
    msg = error_of(p)
    assert "not valid YAML at line 3, column 9" in msg, msg
    assert "\n" not in msg


def test_unknown_key_gets_the_closest_known_one(tmp_path: Path) -> None:
    assert error_of(settings_file(tmp_path, "pollIntervall: 30\n")).endswith(
        "unknown setting 'pollIntervall' (did you mean pollInterval?)"
    )
    assert error_of(settings_file(tmp_path, "POLLINTERVAL: 30\n")).endswith("(did you mean pollInterval?)")
    assert error_of(settings_file(tmp_path, "completelyUnrelated: 1\n")).endswith(
        "unknown setting 'completelyUnrelated'"
    )


def test_snake_case_keys_are_refused_with_their_camel_case_form(tmp_path: Path) -> None:
    msg = error_of(settings_file(tmp_path, "poll_interval: 30\n"))
    assert msg.endswith("unknown setting 'poll_interval': keys are camelCase, write pollInterval"), msg
    assert config_mod.load(None, environ={"GPU_READY_CONFIG": str(settings_file(tmp_path, "pollInterval: 45\n"))})


def test_configuration_error_is_exit_2_with_one_line(tmp_path: Path) -> None:
    p = settings_file(tmp_path, "poll_interval: 30\n")
    r = run("check", "--config", str(p))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "write pollInterval" in r.stderr, r.stderr


def test_top_help_lists_every_command() -> None:
    r = run("--help")
    assert r.returncode == 0
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, cli.argparse._SubParsersAction))
    for command in sub.choices:
        line = next((x for x in r.stdout.splitlines() if x.split()[:1] == [command]), None)
        assert line is not None and len(line.split()) > 1, f"{command} is not listed with its meaning"


@pytest.mark.parametrize("command", ["controller", "preflight", "uninstall"])
def test_help_gives_every_flag_meaning_and_default(command: str) -> None:
    parser = cli.command_parser(cli.build_parser(argv=[command]), command)
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help" and a.help != cli.argparse.SUPPRESS]
    assert len(flags) >= 8
    for a in flags:
        assert a.help and a.help != a.dest.replace("_", " "), f"{command} {a.option_strings[0]} has no meaning"
        if a.required or a.default not in (None, False):
            assert "default" in a.help or "required" in a.help, f"{command} {a.option_strings[0]}: {a.help}"
    text = run(command, "--help").stdout
    assert "(required)" in text and "(default:" in " ".join(text.split())


def test_output_flag_parses_as_kubectl_does() -> None:
    p = cli.build_parser(argv=["check"])
    for argv, want in (([], None), (["-o", "json"], "json"), (["--json"], "json"), (["-o", "yaml"], "yaml"),
                       (["--output=wide"], "wide")):  # fmt: skip
        for command in ("check", "gpus"):
            assert p.parse_args([command, *argv]).output == want
    r = run("check", "-o", "xml")
    assert r.returncode == 2 and "invalid choice: 'xml'" in r.stderr and r.stderr.count("\n") == 1


def check(simhost: Any, *extra: str) -> subprocess.CompletedProcess[str]:
    return run("check", *simhost.check_args(), *extra)


def test_check_prints_json_yaml_and_wide(simhost: Any) -> None:
    simhost.set_smi(err={3: ("Temp",)})
    as_json = check(simhost, "-o", "json")
    assert as_json.returncode == 1, as_json.stderr
    obj = json.loads(as_json.stdout)
    assert json.loads(check(simhost, "--json").stdout)["reason"] == obj["reason"] == "NvidiaSmiErr"
    as_yaml = yaml.safe_load(check(simhost, "-o", "yaml").stdout)
    assert as_yaml.keys() == obj.keys() and as_yaml["gpus"] == obj["gpus"]
    table, wide = check(simhost).stdout.splitlines(), check(simhost, "-o", "wide").stdout.splitlines()
    assert "REMEDY" not in table[0] and "REMEDY" in wide[0] and "UNCHECKED" in wide[0]
    assert len(wide) == len(table)


@pytest.mark.apiserver
def test_check_unknown_node_is_a_usage_error(simhost: Any, control_plane: Any, tmp_path: Path) -> None:
    kc = control_plane.kubeconfig(tmp_path / "kc")
    r = check(simhost, "--node", "no-such-node-x1", "--kubeconfig", str(kc))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == "" and r.stderr == "gpu-ready: --node no-such-node-x1: no such Node in this cluster\n"
