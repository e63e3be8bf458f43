"""structlog setup: JSON when stderr is not a terminal (containers), readable on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


class _Stderr:
    """Whatever sys.stderr is at the time of writing (tests swap it; a captured stream may be closed)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def setup_logging(fmt: str = "auto", level: str = "info") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def get_logger(**context: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger("gpu-ready").bind(**context)
