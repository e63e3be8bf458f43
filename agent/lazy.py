"""Importing one module of a big package without running the package's `__init__`.

`import kubernetes` runs `kubernetes/__init__.py`, which imports every subpackage (config, dynamic, watch,
stream, utils, the generated models: ~500 modules, +30 MiB) although the agent only calls the REST layer
(`kubernetes.client.rest`, `.configuration`, `.exceptions`). `import_light("kubernetes.client.rest")`
registers each parent package as a *deferred* module: the real package object (spec, `__path__`, `__file__`)
whose `__init__` has not run yet. Submodules import through its `__path__` as usual; the first access to a
name the package `__init__` would have defined (`kubernetes.client.CoreV1Api`, `from kubernetes import
watch`) runs the real `__init__` in place, so code that later imports the package the ordinary way still
sees the whole package. Nothing is patched in the library.

A client upgrade that moves or renames a module makes `import_light` raise ImportError; callers fall back to
the plain import (agent/kube.py does), and tests/test_footprint.py pins the module count and memory of the
light path so a change that brings the weight back fails CI."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

_lock = threading.RLock()


class DeferredPackage(types.ModuleType):
    """A package whose `__init__` runs on the first lookup of a name it does not have yet."""

    _deferred_loading = False
    _deferred_done = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name.startswith("_deferred"):
            raise AttributeError(name)
        with _lock:
            if not self._deferred_loading and not self._deferred_done:
                load_deferred(self)
        d = self.__dict__
        if name in d:
            return d[name]
        hook = d.get("__getattr__")  # the package's own lazy names (PEP 562), as kubernetes.client has
        if callable(hook) and self._deferred_done:
            return hook(name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")


def load_deferred(module: types.ModuleType) -> None:
    """Runs a deferred package's real `__init__` (once); a no-op for any other module."""
    if not isinstance(module, DeferredPackage) or module._deferred_done or module._deferred_loading:
        return
    spec = module.__spec__
    assert spec is not None and spec.loader is not None
    module._deferred_loading = True
    try:
        spec.loader.exec_module(module)
        module._deferred_done = True
    finally:
        module._deferred_loading = False


def is_deferred(name: str) -> bool:
    """True while `name` is a package registered by import_light whose `__init__` has not run."""
    m = sys.modules.get(name)
    return isinstance(m, DeferredPackage) and not m._deferred_done


def _defer_package(name: str) -> None:
    if name in sys.modules:
        return
    parent, _, child = name.rpartition(".")
    if parent:
        _defer_package(parent)
        parent_module = sys.modules[parent]
        search = getattr(parent_module, "__path__", None)
        if search is None:
            raise ImportError(f"{parent} is not a package")
        spec = importlib.util.find_spec(name)
    else:
        spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        raise ImportError(f"no package {name}")
    module = importlib.util.module_from_spec(spec)
    module.__class__ = DeferredPackage
    sys.modules[name] = module
    if parent:
        setattr(sys.modules[parent], child, module)


def import_light(name: str) -> types.ModuleType:
    """Imports module `name` (a dotted path) with every parent package deferred (see the module docstring).
    Parents already imported are used as they are. Raises ImportError when the module is not there; the
    deferred parents it registered stay usable (their `__init__` runs on first use)."""
    with _lock:
        parent = name.rpartition(".")[0]
        if parent:
            _defer_package(parent)
        return importlib.import_module(name)
