"""Hostile kernel-log text for the parsers: records built to make a backtracking or rescanning parser take time
quadratic (or worse) in their length. tests/test_xid_fixtures.py checks what the parser does with each;
bench/parsing.py times it."""

from __future__ import annotations

HOSTILE_XID = {
    "100 KB record, no closing parenthesis": "NVRM: Xid (PCI:0000:01:00" + "0" * 100_000,
    "100 KB of spaces inside the parenthesis": "NVRM: Xid (PCI:0000:01:00 " + " " * 100_000 + "): 13",
    "many open prefixes": "NVRM: Xid (" * 10_000,
    "many short lines": ("NVRM: Xid (PCI:" + "a" * 20 + "\n") * 5_000,
    "long address": "NVRM: GPU " + "0:" * 50_000,
    "repeated fallen-off prefix": "NVRM: GPU 0000:01:00.0: GPU has" * 3_000,
    "repeated SXid prefix": "nvidia-nvswitch0: SXid (PCI:" * 4_000,
    "NVLink5 registers without end": "NVRM: Xid (PCI:0000:01:00): 145, " + "(0x1 " * 20_000,
    "repeated The NVIDIA GPU": "NVRM: The NVIDIA GPU " * 5_000,
}

# A 4 MB watch event arriving in 100-byte pieces: rescanning the buffer on every piece would read ~80 GB.
LONG_LINE_CHUNKS = [b"y" * 100] * 40_000 + [b"\n"]
