"""Kernel-log link changes of InfiniBand/RoCE ports (the ConnectX driver, mlx5_core).

A link-change record wakes the runner for an immediate cycle; it latches nothing and judges nothing: the rails
probe (agent/probes/infiniband.py) reads the ports in sysfs on that cycle and judges them. The records
(docs/fabric.md "The kernel-log wake"):

- "mlx5_core 0000:9d:00.1 enp157s0f1np1: Link down" / "... bootnet: Link up": the Ethernet (RoCE) netdev's
  carrier, printed by mlx5e_update_carrier() with netdev_info(priv->netdev, "Link up\\n" / "Link down\\n")
  (drivers/net/ethernet/mellanox/mlx5/core/en_main.c). netdev_info() prefixes "<driver> <device> <ifname>: ".
- "mlx5_core 0000:1b:00.1: Port module event: module 1, Cable unplugged": the port's cable module (plugged,
  unplugged, error, disabled), printed by the event handler with mlx5_core_info(dev, "Port module event:
  module %u, %s\\n", ...) (drivers/net/ethernet/mellanox/mlx5/core/events.c); the error form is
  mlx5_core_err(dev, "Port module event[error]: module %u, %s, %s\\n", ...), which mlx5_core_err prefixes with
  "<function>:<line>:(pid <pid>): ". This one covers InfiniBand ports too: the IB driver (mlx5_ib) and the IB
  core print nothing when a port's state changes, and the IPoIB netdev has no carrier print.

Every expression is anchored on the literal "mlx5_core " and has bounded quantifiers, and a line is cut to
MAX_LINE characters first (as xid.py does), so matching is linear in the input whatever it holds.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from agent.kernel_log.xid import MAX_LINE

_ADDR = r"(?P<addr>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])"
# netdev names are at most 15 characters (IFNAMSIZ - 1) and hold no space, '/' or ':'.
CARRIER_RE = re.compile(r"\bmlx5_core " + _ADDR + r" (?P<ifname>[^\s/:]{1,15}): Link (?P<state>up|down)$")
MODULE_RE = re.compile(
    r"\bmlx5_core "
    + _ADDR
    + r": (?:[A-Za-z0-9_]{1,64}:\d{1,6}:\(pid \d{1,10}\): )?"  # mlx5_core_err's "<function>:<line>:(pid N): "
    + r"Port module event(?:\[error\])?: module (?P<module>\d{1,4}), "
    + r"(?P<state>Cable (?:plugged|unplugged|error|disabled)|Unknown status)\b"
)


class LinkChange(NamedTuple):
    """One link-change record: the NIC's PCI function, the netdev (carrier records) or the cable module
    (module records), and what the record says ("up", "down", "Cable unplugged", ...)."""

    address: str
    ifname: str | None
    module: int | None
    state: str
    text: str

    @property
    def subject(self) -> str:
        where = self.ifname if self.ifname is not None else f"module {self.module}"
        return f"{self.address} {where}"


def parse_link_change(text: str) -> LinkChange | None:
    """The link change a kernel-log message reports, or None. Only the record's first line is read, cut to
    MAX_LINE characters before any pattern sees it."""
    if "mlx5_core" not in text or ("Link " not in text and "Port module event" not in text):
        return None  # the fast path: almost every record
    return _match_line(text[:MAX_LINE].split("\n", 1)[0].rstrip())


def _match_line(line: str) -> LinkChange | None:
    m = CARRIER_RE.search(line)
    if m:
        return LinkChange(m["addr"].lower(), m["ifname"], None, m["state"], line)
    m = MODULE_RE.search(line)
    if m:
        return LinkChange(m["addr"].lower(), None, int(m["module"]), m["state"], line)
    return None
