"""Stock vLLM's fixcheck module in place of the fork's, for the GPU bundle's proof that
its cases fail without the fix (docs/gpu-nightly.md, "What the first run proves").

A pytest plugin (`-p` proofs.OVERLAY), standard library only: the module
(fixcheck.MODULE_PATH) is loaded from the file ENV names. When REPORT_ENV names a file,
it gets a JSON line when the module loads ("loaded": where from, the fix verdict of its
FUNCTION as the module's other functions will call it) and at the first call of that
function in each process ("ran": the file and verdict of the code that ran, and the
case). The runner's verdict rests on these, not on the setting.
"""

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys
import types

from forkbuild.core import fixcheck
from forkbuild.gpu.bundle.proofs import ENV, REPORT_ENV

MODULE = fixcheck.MODULE_PATH[:-3].replace("/", ".")


def record(event: dict) -> None:
    """One JSON line to REPORT_ENV's file (appended: forked children write too)."""
    if path := os.environ.get(REPORT_ENV):
        with open(path, "a") as report:
            report.write(json.dumps(event) + "\n")


def verdict_of(code: types.CodeType) -> str:
    """fixcheck's verdict on the source of CODE, as its file holds it."""
    try:
        return fixcheck.classify(inspect.getsource(code))
    except (OSError, TypeError):
        return "unknown"


def watch(module: types.ModuleType) -> None:
    """Record MODULE's FUNCTION as loaded, and its first call in each process: a
    wrapper in its place in the module, which the module's callers look up at each
    call, records and calls it unchanged (any Python: the host's may be 3.11)."""
    function = getattr(module, fixcheck.FUNCTION)
    code = function.__code__
    verdict = verdict_of(code)
    record({"event": "loaded", "origin": code.co_filename, "verdict": verdict})
    recorded = set()  # the processes that recorded a call (forked children copy it)

    @functools.wraps(function)
    def recording(*args, **kwargs):
        if os.getpid() not in recorded:
            recorded.add(os.getpid())
            case = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
            origin = code.co_filename
            record({"event": "ran", "origin": origin, "verdict": verdict, "case": case})
        return function(*args, **kwargs)

    setattr(module, fixcheck.FUNCTION, recording)


class _Watching(importlib.abc.Loader):
    """INNER's module, watched once it has run."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.inner.exec_module(module)
        watch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """MODULE from STOCK, a file."""

    def __init__(self, stock: str) -> None:
        self.stock = stock

    def find_spec(self, fullname, path=None, target=None):
        if fullname != MODULE:
            return None
        inner = importlib.machinery.SourceFileLoader(fullname, self.stock)
        return importlib.util.spec_from_file_location(
            fullname, self.stock, loader=_Watching(inner)
        )


def install(stock: str) -> None:
    """The finder first on sys.meta_path: before anything imports MODULE."""
    if MODULE in sys.modules:
        raise RuntimeError(f"stock_overlay: {MODULE} was imported before the plugin")
    if not os.path.isfile(stock):
        raise RuntimeError(f"stock_overlay: {ENV} names {stock!r}, which is no file")
    sys.meta_path.insert(0, _Finder(stock))


install(os.environ.get(ENV, ""))
