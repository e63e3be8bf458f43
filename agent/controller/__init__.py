"""`gpu-ready controller`: runs the chart's preflight Job where it is needed and publishes the fleet brake
(docs/controller.md). main.py wires and loops, plan.py decides (pure), lease.py elects one active replica,
informer.py keeps the caches."""

from __future__ import annotations

from agent.controller.main import add_arguments, main

__all__ = ["add_arguments", "main"]
