"""Optional loader of the compiled CUDA row kernels, ``megatron.context_parallel._C``.

The extension exists only when the install found a CUDA toolchain (see ``setup.py``). Three
outcomes are told apart, because they call for different reactions:

* ``"loaded"``: the kernels are registered for the ``megatron_cp`` ops on CUDA tensors.
* ``"not built"``: a pure-Python install (torch without CUDA, or no nvcc at build time). Not an
  error; CUDA tensors fall back to torch indexing, with one warning when that first happens.
* ``"broken"``: a library is there but does not load (torch version or CUDA mismatch, missing
  symbols). Warned about at once, since a rebuild is needed; CUDA tensors fall back too.

Set ``MCP_REQUIRE_EXTENSION=1`` to make both non-loaded outcomes raise instead (benchmarks and
GPU tests do, so they never time the fallback by mistake), and ``MCP_DISABLE_EXTENSION=1`` to
ignore a built extension (tests of the fallback; bisecting a suspected kernel bug).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from typing import Optional, Tuple

import torch

__all__ = ["load", "status", "warn_fallback_once"]

_MODULE = "megatron.context_parallel._C"
_state: Optional[Tuple[str, str]] = None
_fallback_warned = False


def _require() -> bool:
    return os.environ.get("MCP_REQUIRE_EXTENSION", "0") not in ("", "0")


def load() -> bool:
    """Imports the extension once (it registers its kernels on import); True when loaded.

    Must run after the ``megatron_cp`` op schemas are defined. Never touches a GPU.
    """
    global _state
    if _state is not None:
        return _state[0] == "loaded"
    if os.environ.get("MCP_DISABLE_EXTENSION", "0") not in ("", "0"):
        _state = ("not built", "disabled by MCP_DISABLE_EXTENSION")
    elif torch.version.cuda is None:
        _state = ("not built", "torch was built without CUDA")
    elif importlib.util.find_spec(_MODULE) is None:
        _state = ("not built", "the package was installed without its CUDA extension")
    else:
        try:
            importlib.import_module(_MODULE)
            _state = ("loaded", "")
        except Exception as exc:  # noqa: BLE001 - any load failure means "broken"
            _state = ("broken", f"{type(exc).__name__}: {exc}")
            if not _require():
                warnings.warn(
                    f"{_MODULE} is installed but failed to load ({_state[1]}); rebuild it with "
                    "`pip install --no-build-isolation -e .`. CUDA tensors use torch indexing.",
                    RuntimeWarning,
                    stacklevel=2,
                )
    if _state[0] != "loaded" and _require() and "MCP_DISABLE_EXTENSION" not in _state[1]:
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
