"""The NVML backend seam: the NVML probe (agent/probes/nvml.py) takes its library as an argument, and this module
gives it two more besides the live `pynvml`:

- `RecordingNvml(lib)`: the live library, passed through, writing down every call the probes make (its name, its
  arguments with GPU handles named `gpu<index>`, and what came back: a value, a structure filled by reference, an
  NVML error code, or nothing at all when the call never returned). `gpu-ready capture` judges the node once through
  it and saves the record as `nvml.json`.
- `RecordedNvml(record)`: answers the same calls from such a record, so `check --replay` runs the very same probe
  code on what the live library said. A call the record does not hold answers NVML's NOT_SUPPORTED (what a library
  says for a reading it does not have) and is listed in `missing`, so a replay says which readings were not captured;
  a call that hung when captured raises the probe's own NvmlTimeout.

Constants, structures, error classes and `byref` come from `pynvml` itself (importing it loads no driver library).
The record is plain JSON: values, lists, and `{"_struct": {field: value}}` for a ctypes structure."""

from __future__ import annotations

import ctypes
import json
import threading
import types
from collections.abc import Mapping
from typing import Any

from agent.probes.nvml import NvmlTimeout

FORMAT = "gpu-ready-nvml/1"
NOT_SUPPORTED = 3
MAX_CALLS = 20_000  # calls recorded at most (a real 8-GPU node makes a few hundred per cycle)
MAX_DEPTH = 6


class Handle:
    """A GPU (or MIG device) handle as the record names it; `live` is the library's own handle while recording."""

    __slots__ = ("key", "live")

    def __init__(self, key: str, live: Any = None) -> None:
        self.key, self.live = key, live

    def __repr__(self) -> str:
        return f"Handle({self.key})"


def _handle_key(name: str, args: tuple[Any, ...]) -> str:
    if name.startswith("nvmlDeviceGetHandleByIndex") and args:
        return f"gpu{int(args[0])}"
    if name.startswith("nvmlDeviceGetMigDeviceHandleByIndex") and len(args) == 2 and isinstance(args[0], Handle):
        return f"{args[0].key}/mig{int(args[1])}"
    return f"{name}:{json.dumps([_plain(a) for a in args])}"


def _plain(v: Any, depth: int = 0) -> Any:
    """A value the library returned (or an argument) as JSON."""
    if depth > MAX_DEPTH:
        return None
    if isinstance(v, Handle):
        return {"_handle": v.key}
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace").rstrip("\0")
    if isinstance(v, (list | tuple, ctypes.Array)):
        return [_plain(x, depth + 1) for x in v]
    if isinstance(v, ctypes.Structure | ctypes.Union):
        return {"_struct": {f[0]: _plain(getattr(v, f[0]), depth + 1) for f in v._fields_}}
    if isinstance(v, ctypes._SimpleCData):
        return _plain(v.value, depth + 1)
    if isinstance(v, types.SimpleNamespace):  # a structure some bindings answer as plain attributes
        return {"_struct": {k: _plain(x, depth + 1) for k, x in vars(v).items() if not k.startswith("_")}}
    return str(v)[:200]


def _live(v: Any) -> Any:
    return v.live if isinstance(v, Handle) else v


def call_key(name: str, args: tuple[Any, ...] | list[Any]) -> str:
    """The record's key of one call: its name and its arguments (a by-reference argument as "&")."""
    shown = ["&" if _is_ref(a) else _plain(a) for a in args]
    return f"{name}{json.dumps(shown, separators=(',', ':'))}"


class _RefMark:
    """Stands for a by-reference argument when a recorded key is rebuilt."""


def _is_ref(a: Any) -> bool:
    return isinstance(a, _RefMark) or type(a).__name__ == "CArgObject" or isinstance(a, ctypes._Pointer)


def _returns_handle(name: str) -> bool:
    return name.startswith("nvmlDeviceGet") and "Handle" in name


def _gpu_of(args: tuple[Any, ...]) -> str | None:
    first = args[0] if args else None
    return first.key.split("/")[0] if isinstance(first, Handle) else None


class RecordingNvml:
    """The live library, every call written down (see the module's docstring)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self.calls: dict[str, dict[str, Any]] = {}  # key -> {"call", "args", "gpu", outcome}
        self.constants: dict[str, int | str] = {}

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._lib, name)
        if name.startswith("NVML_") and isinstance(target, int | str):
            self.constants[name] = target  # the library's own limits and codes, replayed as they were
        if not name.startswith("nvml") or not callable(target):
            return target

        def recorded(*args: Any) -> Any:
            key = call_key(name, args)
            entry: dict[str, Any] = {"call": name, "args": json.loads(key[len(name) :]), "hung": True}
            gpu = _gpu_of(args) or (_handle_key(name, args) if name.startswith("nvmlDeviceGetHandleByIndex") else None)
            if gpu is not None:
                entry["gpu"] = gpu
            with self._lock:
                if len(self.calls) < MAX_CALLS:
                    self.calls[key] = entry
            try:
                value = target(*[_live(a) for a in args])
            except self._lib.NVMLError as e:
                entry.pop("hung")
                entry["error"] = getattr(e, "value", None)
                raise
            entry.pop("hung")
            refs = [a for a in args if _is_ref(a)]
            if refs:
                entry["out"] = _plain(getattr(refs[0], "_obj", None))
            if isinstance(value, ctypes._Pointer) or _returns_handle(name):  # named, kept for the calls using it
                return Handle(_handle_key(name, args), value)
            entry["value"] = _plain(value)
            return value

        recorded.__name__ = name
        return recorded

    def to_json(self) -> dict[str, Any]:
        """`nvml.json`: the calls not about one GPU, then each GPU's calls (its MIG devices' included)."""
        with self._lock:
            entries = list(self.calls.values())
        gpus: dict[str, list[dict[str, Any]]] = {}
        system: list[dict[str, Any]] = []
        for e in entries:
            gpu = e.pop("gpu", None)
            (gpus.setdefault(gpu, []) if gpu is not None else system).append(e)
        return {
            "format": FORMAT,
            "constants": dict(sorted(self.constants.items())),
            "calls": system,
            "gpus": [{"gpu": k, "calls": v} for k, v in gpus.items()],
        }


def _namespace(v: Any) -> Any:
    if isinstance(v, list):
        return [_namespace(x) for x in v]
    if isinstance(v, dict):
        if "_handle" in v:
            return Handle(str(v["_handle"]))
        if "_struct" in v and isinstance(v["_struct"], dict):
            return types.SimpleNamespace(**{str(k): _namespace(x) for k, x in v["_struct"].items()})
    return v


def _fill(obj: Any, data: Any) -> None:
    """Fills a ctypes structure passed by reference from a recorded one, field by field (fields of another version
    of the structure that this one lacks are left out; fields the record lacks stay zero)."""
    if not isinstance(data, dict) or not isinstance(data.get("_struct"), dict):
        return
    fields = data["_struct"]
    for f in getattr(obj, "_fields_", ()):
        name, kind = f[0], f[1]
        if name not in fields:
            continue
        value = fields[name]
        current = getattr(obj, name)
        if isinstance(current, ctypes.Array) and isinstance(value, list):
            for i, x in enumerate(value[: len(current)]):
                if isinstance(x, int | float):
                    current[i] = x
        elif isinstance(current, ctypes.Structure | ctypes.Union):
            _fill(current, value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            try:
                setattr(obj, name, kind(value).value if isinstance(value, float) else value)
            except (TypeError, ValueError, OverflowError):
                continue


class RecordError(ValueError):
    pass


def check_record(data: Any) -> list[dict[str, Any]]:
    """The record's calls (every GPU's and the others'); RecordError (one line) when it is not one."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise RecordError(f"nvml.json: not a {FORMAT} record")
    calls = data.get("calls", [])
    gpus = data.get("gpus", [])
    if not isinstance(calls, list) or not isinstance(gpus, list):
        raise RecordError("nvml.json: calls and gpus must be lists")
    out = list(calls)
    for g in gpus:
        if not isinstance(g, Mapping) or not isinstance(g.get("calls"), list):
            raise RecordError("nvml.json: each GPU needs a list of calls")
        out += g["calls"]
    if len(out) > MAX_CALLS:
        raise RecordError(f"nvml.json: more than {MAX_CALLS} calls")
    for c in out:
        if not isinstance(c, Mapping) or not isinstance(c.get("call"), str) or not isinstance(c.get("args", []), list):
            raise RecordError("nvml.json: a call needs a name and a list of arguments")
    return out


class RecordedNvml:
    """Answers NVML calls from a record (see the module's docstring)."""

    def __init__(self, record: Mapping[str, Any]) -> None:
        import pynvml

        self._lib = pynvml
        self._answers = {call_key(c["call"], _refs(c.get("args", []))): c for c in check_record(record)}
        self.missing: list[str] = []  # keys asked for and not in the record, in order, once each
        consts = record.get("constants", {})
        self._constants = (
            {str(k): v for k, v in consts.items() if isinstance(v, int | str)} if isinstance(consts, Mapping) else {}
        )

    def __getattr__(self, name: str) -> Any:
        if name in self._constants:
            return self._constants[name]
        if not name.startswith("nvml"):
            return getattr(self._lib, name)

        def answer(*args: Any) -> Any:
            key = call_key(name, args)
            c = self._answers.get(key)
            if c is None:
                if key not in self.missing:
                    self.missing.append(key)
                raise self._lib.NVMLError(NOT_SUPPORTED)
            if c.get("hung"):
                raise NvmlTimeout(f"{name} did not return when the bundle was captured")
            if c.get("error") is not None:
                raise self._lib.NVMLError(int(c["error"]))
            if "out" in c:
                ref = next((a for a in args if _is_ref(a)), None)
                if ref is not None:
                    _fill(getattr(ref, "_obj", ref), c["out"])
            value = c.get("value")
            if isinstance(value, dict) and "_handle" not in value and "_struct" not in value:
                return value
            if value is None and _returns_handle(name):
                return Handle(_handle_key(name, args))
            return _namespace(value)

        answer.__name__ = name
        return answer


def _refs(args: list[Any]) -> list[Any]:
    """Recorded arguments as call_key shows them ("&" stays "&"; a handle stays a handle)."""
    return [
        _RefMark() if a == "&" else (Handle(str(a["_handle"])) if isinstance(a, dict) and "_handle" in a else a)
        for a in args
    ]
