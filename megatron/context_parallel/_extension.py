"""Optional loaders of the compiled parts: the CUDA row kernels (``megatron.context_parallel._C``)
and the attention's host table builders (``megatron.context_parallel._host``, ``host_tables``).

The extension exists only when the install found a CUDA toolchain (see ``setup.py``). Three
outcomes are told apart, because they call for different reactions:

* ``"loaded"``: the kernels are registered for the ``megatron_cp`` ops on CUDA tensors.
* ``"not built"``: a pure-Python install (torch without CUDA, or no nvcc at build time). Not an
  error; CUDA tensors fall back to torch indexing, with one warning when that first happens.
* ``"broken"``: a library is there but does not load (torch version or CUDA mismatch, missing
  symbols). Warned about at once, since a rebuild is needed; CUDA tensors fall back too.

Two environment variables change this (on/off values follow ``_env.env_flag``: 1/true/yes/on,
0/false/no/off/empty, anything else raises ``ValueError``):

* ``MCP_REQUIRE_EXTENSION=1``: both non-loaded outcomes raise ``ImportError`` instead (benchmarks
  and GPU tests set it, so they never time the fallback by mistake).
* ``MCP_DISABLE_EXTENSION=1``: ignore a built extension, as if it were not built (tests of the
  fallback; bisecting a suspected kernel bug). A deliberate choice, so it wins over
  ``MCP_REQUIRE_EXTENSION``.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import Optional, Tuple

import torch

from megatron.context_parallel._env import env_flag

__all__ = ["host_status", "host_tables", "load", "status", "warn_fallback_once"]

_MODULE = "megatron.context_parallel._C"
_HOST_MODULE = "megatron.context_parallel._host"
_state: Optional[Tuple[str, str]] = None
_host_state: Optional[Tuple[str, str]] = None
_fallback_warned = False


def _module_exists() -> bool:
    return importlib.util.find_spec(_MODULE) is not None


def _import_module() -> None:
    importlib.import_module(_MODULE)


def _probe() -> Tuple[str, str]:
    """``(outcome, reason)`` of one attempt to load the extension; never raises on a load error."""
    if env_flag("MCP_DISABLE_EXTENSION"):
        return "not built", "disabled by MCP_DISABLE_EXTENSION"
    if torch.version.cuda is None:
        return "not built", "torch was built without CUDA"
    if not _module_exists():
        return "not built", "the package was installed without its CUDA extension"
    try:
        _import_module()
    except Exception as exc:  # noqa: BLE001 - any load failure means "broken"
        return "broken", f"{type(exc).__name__}: {exc}"
    return "loaded", ""


def load() -> bool:
    """Imports the extension once (it registers its kernels on import); True when loaded.

    Must run after the ``megatron_cp`` op schemas are defined. Never touches a GPU.

    Raises:
        ImportError: ``MCP_REQUIRE_EXTENSION`` is on and the extension is not loaded (unless
            ``MCP_DISABLE_EXTENSION`` is on too).
        ValueError: one of the two variables holds neither an on nor an off value.
    """
    global _state
    require = env_flag("MCP_REQUIRE_EXTENSION")
    if _state is None:
        _state = _probe()
        if _state[0] == "broken" and not require:
            warnings.warn(
                f"{_MODULE} is installed but failed to load ({_state[1]}); rebuild it with "
                "`pip install --no-build-isolation -e .`. CUDA tensors use torch indexing.",
                RuntimeWarning,
                stacklevel=2,
            )
    if _state[0] != "loaded" and require and not env_flag("MCP_DISABLE_EXTENSION"):
        raise ImportError(f"MCP_REQUIRE_EXTENSION is set but {_MODULE} is {_state[0]}: {_state[1]}")
    return _state[0] == "loaded"


def status() -> Tuple[str, str]:
    """``(outcome, reason)`` of :func:`load`: outcome is ``loaded``, ``not built`` or ``broken``."""
    load()
    assert _state is not None
    return _state


def warn_fallback_once(op: str) -> None:
    """Warns, the first time only, that a CUDA tensor went through the torch fallback."""
    global _fallback_warned
    if _fallback_warned:
        return
    _fallback_warned = True
    outcome, reason = status()
    warnings.warn(
        f"megatron_cp::{op} on a CUDA tensor without the compiled kernels ({outcome}: {reason}); "
        "using torch indexing, which is correct but slower. Build the extension with "
        "`pip install --no-build-isolation -e .` on a machine with nvcc.",
        UserWarning,
        stacklevel=3,
    )


# The host-table ops the package calls. A library built from older sources registers another
# set (or older schemas under the same names), so a missing one marks it broken: the tables are
# then built with torch ops, and the warning says to rebuild.
_HOST_OPS = (
    "compact_keys", "sequence_starts", "rank_keys", "run_tables", "split_tables", "call_tables",
    "group_tables", "tile_cost", "run_cost", "block_tables", "block_cost",
)  # fmt: skip


def _import_host_module() -> None:
    importlib.import_module(_HOST_MODULE)
    ops = torch.ops.megatron_cp_host
    missing = [name for name in _HOST_OPS if not hasattr(ops, name)]
    if missing:
        raise ImportError(f"built from older sources (no {', '.join(missing)})")


def host_tables():
    """``torch.ops.megatron_cp_host`` (the C++ builders of the attention tables, CPU tensors
    only), or None where they are not built or disabled: callers then build the same tables
    with torch ops. Loaded once; a library that fails to load warns once, as ``load`` does.

    Raises:
        ImportError: ``MCP_REQUIRE_EXTENSION`` is on and the builders are not loaded (unless
            ``MCP_DISABLE_EXTENSION`` is on too).
    """
    global _host_state
    if _host_state is None:
        if env_flag("MCP_DISABLE_EXTENSION"):
            _host_state = ("not built", "disabled by MCP_DISABLE_EXTENSION")
        elif importlib.util.find_spec(_HOST_MODULE) is None:
            _host_state = ("not built", "the package was installed without its host tables")
        else:
            try:
                _import_host_module()
                _host_state = ("loaded", "")
            except Exception as exc:  # noqa: BLE001 - any load failure means "broken"
                _host_state = ("broken", f"{type(exc).__name__}: {exc}")
                warnings.warn(
                    f"{_HOST_MODULE} is installed but failed to load ({_host_state[1]}); "
                    "rebuild with `pip install --no-build-isolation -e .`. Attention tables "
                    "are built with torch ops.",
                    RuntimeWarning,
                    stacklevel=2,
                )
    if _host_state[0] == "loaded":
        return torch.ops.megatron_cp_host
    if env_flag("MCP_REQUIRE_EXTENSION") and not env_flag("MCP_DISABLE_EXTENSION"):
        raise ImportError(
            f"MCP_REQUIRE_EXTENSION is set but {_HOST_MODULE} is {_host_state[0]}: "
            f"{_host_state[1]}"
        )
    return None


def host_status() -> Tuple[str, str]:
    """``(outcome, reason)`` of :func:`host_tables`, as :func:`status` tells of the kernels.

    Raises as ``host_tables`` does."""
    host_tables()
    assert _host_state is not None
    return _host_state
