"""Prints the summary table from the JSON files the last benchmark run saved in bench/out/ (`make bench`), the
fleet benchmark's (bench/fleet.py, saved as fleet.json) among them, with the fleet's own report. A benchmark
that has not been run is named, not guessed."""

from __future__ import annotations

import json
from typing import Any

from bench import fleet
from bench.common import OUT, machine
from bench.run_all import ratios, summary

NAMES = ("latency", "storm", "write_rate", "npd_compare", "footprint", "fleet")
OPTIONAL = ("storm_against",)  # rows shown when their benchmark was run (bench.storm --against)


def load_results() -> tuple[dict[str, Any], list[str]]:
    """The saved results by benchmark name, and the names with no (readable) result file."""
    results: dict[str, Any] = {}
    missing: list[str] = []
    for name in NAMES:
        try:
            results[name] = json.loads((OUT / f"{name}.json").read_text())
        except (OSError, ValueError):
            missing.append(name)
    for name in OPTIONAL:
        try:
            results[name] = json.loads((OUT / f"{name}.json").read_text())
        except (OSError, ValueError):
            pass
    return results, missing


def main() -> int:
    r, missing = load_results()
    if not r:
        print(f"bench.report: no results in {OUT}/: run `make bench` (or python -m bench.<name>) first")
        return 2
    print(f"Machine: {machine()}")
    if missing:
        print(f"Not run (no {', '.join(f'{n}.json' for n in missing)} in {OUT}/)")
    if all(n in r for n in NAMES[:-1]):
        print(summary(r))
    if "npd_compare" in r:
        print(ratios(r["npd_compare"]))
    if "fleet" in r:
        print("\nFleet:\n" + fleet.report(r["fleet"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
