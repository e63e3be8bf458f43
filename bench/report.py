"""Prints the summary table from the JSON files the last benchmark run saved in bench/out/."""

from __future__ import annotations

import json

from bench.common import OUT, machine
from bench.run_all import summary


def main() -> None:
    names = ("latency", "storm", "write_rate", "npd_compare", "footprint")
    r = {n: json.loads((OUT / f"{n}.json").read_text()) for n in names}
    print(f"Machine: {machine()}")
    print(summary(r))


if __name__ == "__main__":
    main()
