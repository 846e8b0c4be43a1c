"""The ``gqadrv`` logger (stdlib ``logging``).

gqadrv logs kernel compiles and cache events through the logger named ``"gqadrv"`` and its
children (``gqadrv.compiler``, ``gqadrv.cache``). As a library it configures nothing by default: the
logger has a ``NullHandler`` only, so records reach whatever the application set up (``caplog``,
``logging.basicConfig``, ...) and nothing is printed otherwise.

``GQADRV_LOG=debug|info|warning|error`` (or a numeric level) sets the logger's level and adds one
stderr handler with a short format (``gqadrv INFO: compiled ...``); it is read when gqadrv's
runtime is first imported, and again by ``configure_from_env()``. What is logged:

* INFO: every compile: module label, arch, cache hit (memory or disk) or miss, seconds; cache
  evictions (GQADRV_CACHE_MAX_BYTES) and ``cache clear``.
* DEBUG: the cache key, NVRTC options and the ptxas resource report of each compile, each evicted
  entry, and the traceback behind a CLI error.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["LOGGER_NAME", "configure_from_env", "get_logger"]

LOGGER_NAME = "gqadrv"
FORMAT = "gqadrv %(levelname)s: %(message)s"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}

_root = logging.getLogger(LOGGER_NAME)
if not any(isinstance(h, logging.NullHandler) for h in _root.handlers):
    _root.addHandler(logging.NullHandler())


def get_logger(name: str | None = None) -> logging.Logger:
    """``gqadrv`` or its child ``gqadrv.<name>``."""
    return _root if not name else _root.getChild(name)


def parse_level(value: str) -> int | None:
    """A logging level from GQADRV_LOG's spelling (None: unset or empty). ValueError if unknown."""
    v = (value or "").strip().lower()
    if not v:
        return None
    if v in _LEVELS:
        return _LEVELS[v]
    if v.isdigit():
        return int(v)
    raise ValueError(f"GQADRV_LOG={value!r}: expected debug, info, warning, error or a number")


def configure_from_env(environ=None) -> logging.Handler | None:
    """Apply GQADRV_LOG: set the ``gqadrv`` logger's level and install (or replace) the one stderr
    handler gqadrv owns. Unset or empty: remove that handler again. Returns the handler or None."""
    env = os.environ if environ is None else environ
    for h in list(_root.handlers):
        if getattr(h, "_gqadrv_env", False):
            _root.removeHandler(h)
    try:
        level = parse_level(env.get("GQADRV_LOG", ""))
    except ValueError as exc:
        warnings.warn(f"gqadrv: {exc}; logging stays off", RuntimeWarning, stacklevel=2)
        return None
    if level is None:
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler._gqadrv_env = True  # type: ignore[attr-defined]
    _root.addHandler(handler)
    _root.setLevel(level)
    return handler


configure_from_env()
