"""Which implementation of the hot path runs: the compiled one (the optional package branch-settlement-native,
built from native/ by `make install` where a Rust toolchain is) or the pure-Python one, which is the reference
(the tests hold the compiled one to it) and the fallback where the extension is not installed.

`SETTLE_IMPLEMENTATION` selects, for every command (`settle --implementation` sets it): `compiled`, `python`, or
`auto` (the default: compiled when installed, else Python). So `settle replay --topic` can re-derive a live run
with the other implementation than the processor's: an audit by an independent implementation.
"""

from __future__ import annotations

import os
from functools import cache
from types import ModuleType

from branch_settlement.errors import ConfigError

ENV = "SETTLE_IMPLEMENTATION"
COMPILED = "compiled"
PYTHON = "python"
AUTO = "auto"
CHOICES = (AUTO, COMPILED, PYTHON)
# The interface native/src/ offers this package (the plan format codegen._plan and event_json.sorted_json_plan
# build, the fold's FoldCore, the processor's MessageFolder and the functions it calls by name): a module built
# from other sources is stale.
PLAN_VERSION = 5


@cache
def _load() -> tuple[ModuleType | None, str]:
    try:
        import branch_settlement_native as module
    except ImportError as err:
        return None, f"branch-settlement-native is not installed ({err}); `make install` builds it with Rust"
    found = getattr(module, "PLAN_VERSION", None)
    if found != PLAN_VERSION:
        return None, (f"the installed branch-settlement-native reads plan version {found}, this package writes "
                      f"{PLAN_VERSION}: rebuild it (`make install`)")
    return module, ""


def module() -> ModuleType | None:
    """The compiled extension, or None when it is not installed (or built from other sources)."""
    return _load()[0]


def select(requested: str | None = None) -> str:
    """COMPILED or PYTHON: `requested`, else $SETTLE_IMPLEMENTATION, else auto. ConfigError for an unknown
    choice, or for `compiled` where the extension is not installed."""
    source = "the implementation asked for" if requested is not None else ENV
    value = (requested if requested is not None else os.environ.get(ENV, "")).strip().lower() or AUTO
    if value not in CHOICES:
        raise ConfigError(f"{source} is {value!r}: expected one of {', '.join(CHOICES)}")
    loaded, why = _load()
    if value == AUTO:
        return COMPILED if loaded is not None else PYTHON
    if value == COMPILED and loaded is None:
        raise ConfigError(f"the compiled implementation was asked for ({source} is compiled), but {why}; "
                          f"or run {ENV}=python")
    return value


def compiled_function(name: str):
    """The compiled module's function `name` where the compiled implementation is selected (`select()`); else None,
    and the caller runs its Python loop."""
    loaded = module()
    return getattr(loaded, name) if loaded is not None and select() == COMPILED else None


def describe(implementation: str) -> str:
    """One phrase for logs and reports: which implementation, and for the compiled one which build."""
    if implementation != COMPILED:
        return "python (the pure-Python reference)"
    version = getattr(module(), "__version__", None) or _distribution_version()
    return f"compiled (branch-settlement-native {version})"


def _distribution_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("branch-settlement-native")
    except PackageNotFoundError:
        return "unknown"
