"""The MCP_* environment variables: one parsing rule, read the same way by setup.py and the loader.

The loader's outcomes are checked by replacing what it probes (torch's CUDA version, whether the
compiled module exists, whether importing it works), so every outcome is exercised on any torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from megatron.context_parallel import _extension
from megatron.context_parallel._env import env_flag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "value,expected",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        (" On ", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
        ("", False),
        ("  ", False),
        (None, False),
    ],
)
def test_env_flag_reads_on_and_off_words(value, expected):
    environ = {} if value is None else {"MCP_X": value}
    assert env_flag("MCP_X", environ) is expected


@pytest.mark.parametrize("value", ["2", "maybe", "enabled", "-1", "truee"])
def test_env_flag_rejects_anything_else_naming_the_variable(value):
    with pytest.raises(ValueError, match=f"MCP_X={value!r} is neither on"):
        env_flag("MCP_X", {"MCP_X": value})


def test_env_flag_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("MCP_X", "on")
    assert env_flag("MCP_X")
    monkeypatch.delenv("MCP_X")
    assert not env_flag("MCP_X")


def _setup_py(env_updates):
    """Runs setup.py up to its build decision (``build_ext --help`` builds nothing)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCP_")}
    env.update(env_updates)
    return subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_setup_py_uses_the_same_rule():
    bad = _setup_py({"MCP_SKIP_CUDA_BUILD": "maybe"})
    assert bad.returncode != 0
    assert "MCP_SKIP_CUDA_BUILD='maybe' is neither on" in bad.stderr
    both = _setup_py({"MCP_SKIP_CUDA_BUILD": "1", "MCP_FORCE_CUDA_BUILD": "yes"})
    assert both.returncode != 0 and "both on" in both.stderr
    # "false" and "off" are off: the decision falls through to the toolchain.
    off = _setup_py({"MCP_SKIP_CUDA_BUILD": "false", "MCP_FORCE_CUDA_BUILD": "off"})
    assert off.returncode == 0, off.stderr
    assert "MCP_SKIP_CUDA_BUILD is set" not in off.stderr
    assert "build summary" in off.stderr
    skip = _setup_py({"MCP_SKIP_CUDA_BUILD": "on"})
    assert skip.returncode == 0 and "skipped (MCP_SKIP_CUDA_BUILD is set)" in skip.stderr


@pytest.fixture
def fresh_loader(monkeypatch):
    """The extension loader with no cached outcome and a CUDA torch whose _C module exists and
    loads; each test changes one of those. Restored afterwards, so the real outcome stays."""
    monkeypatch.setattr(_extension, "_state", None)
    monkeypatch.setattr(_extension, "_fallback_warned", False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_extension, "_module_exists", lambda: True)
    monkeypatch.setattr(_extension, "_import_module", lambda: None)
    monkeypatch.delenv("MCP_REQUIRE_EXTENSION", raising=False)
    monkeypatch.delenv("MCP_DISABLE_EXTENSION", raising=False)
    return monkeypatch


def _fail_import():
    raise OSError("undefined symbol: _ZN3c10")


def test_loader_outcomes(fresh_loader):
    assert _extension.load() and _extension.status() == ("loaded", "")

    fresh_loader.setattr(_extension, "_state", None)
    fresh_loader.setattr(torch.version, "cuda", None)
    assert not _extension.load()
    assert _extension.status() == ("not built", "torch was built without CUDA")

    fresh_loader.setattr(_extension, "_state", None)
    fresh_loader.setattr(torch.version, "cuda", "13.0")
    fresh_loader.setattr(_extension, "_module_exists", lambda: False)
    assert not _extension.load()
    assert "installed without its CUDA extension" in _extension.status()[1]


def test_broken_extension_warns_once_and_falls_back(fresh_loader):
    fresh_loader.setattr(_extension, "_import_module", _fail_import)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not _extension.load()
        assert not _extension.load()
    assert [type(w.message) for w in caught] == [RuntimeWarning]
    assert "undefined symbol" in str(caught[0].message)
    assert _extension.status()[0] == "broken"


@pytest.mark.parametrize("cuda,exists", [(None, True), ("13.0", False)])
def test_require_turns_not_built_into_an_error(fresh_loader, cuda, exists):
    fresh_loader.setattr(torch.version, "cuda", cuda)
    fresh_loader.setattr(_extension, "_module_exists", lambda: exists)
    fresh_loader.setenv("MCP_REQUIRE_EXTENSION", "1")
    with pytest.raises(ImportError, match="MCP_REQUIRE_EXTENSION is set but .* is not built"):
        _extension.load()


def test_require_turns_broken_into_an_error_without_a_warning(fresh_loader):
    fresh_loader.setattr(_extension, "_import_module", _fail_import)
    fresh_loader.setenv("MCP_REQUIRE_EXTENSION", "yes")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ImportError, match="is broken: OSError: undefined symbol"):
            _extension.load()


def test_require_false_means_off(fresh_loader):
    # The reported bug: "false" used to count as on, because only "" and "0" were off.
    fresh_loader.setattr(torch.version, "cuda", None)
    fresh_loader.setenv("MCP_REQUIRE_EXTENSION", "false")
    assert not _extension.load()


def test_disable_ignores_a_loadable_extension_and_wins_over_require(fresh_loader):
    imported = []
    fresh_loader.setattr(_extension, "_import_module", lambda: imported.append(1))
    fresh_loader.setenv("MCP_DISABLE_EXTENSION", "1")
    fresh_loader.setenv("MCP_REQUIRE_EXTENSION", "1")
    assert not _extension.load()
    assert _extension.status() == ("not built", "disabled by MCP_DISABLE_EXTENSION")
    assert imported == []


def test_loader_rejects_a_bad_value(fresh_loader):
    fresh_loader.setenv("MCP_DISABLE_EXTENSION", "sometimes")
    with pytest.raises(ValueError, match="MCP_DISABLE_EXTENSION='sometimes'"):
        _extension.load()


def test_host_tables_loader_outcomes(monkeypatch):
    # The host-table library follows the same switches: disabled -> None (torch-op tables),
    # required but missing -> ImportError, broken -> one warning and None.
    for name in ("MCP_REQUIRE_EXTENSION", "MCP_DISABLE_EXTENSION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_extension, "_host_state", None)
    monkeypatch.setenv("MCP_DISABLE_EXTENSION", "1")
    monkeypatch.setenv("MCP_REQUIRE_EXTENSION", "1")
    assert _extension.host_tables() is None

    monkeypatch.setattr(_extension, "_host_state", None)
    monkeypatch.delenv("MCP_DISABLE_EXTENSION")
    monkeypatch.setattr(_extension, "_HOST_MODULE", "megatron.context_parallel._no_such_module")
    with pytest.raises(ImportError, match="is not built: the package was installed without"):
        _extension.host_tables()

    monkeypatch.setattr(_extension, "_host_state", None)
    monkeypatch.delenv("MCP_REQUIRE_EXTENSION")
    monkeypatch.setattr(_extension, "_HOST_MODULE", "megatron.context_parallel.comm.plan")
    monkeypatch.setattr(_extension, "_import_host_module", _fail_import)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _extension.host_tables() is None
        assert _extension.host_tables() is None
    assert [type(w.message) for w in caught] == [RuntimeWarning]
    assert "undefined symbol" in str(caught[0].message)


_import_host_module = _extension._import_host_module  # the real one (tests patch it)


@pytest.mark.skipif(_extension.host_tables() is None, reason="host builders not built")
def test_host_tables_built_from_older_sources_are_broken(monkeypatch):
    # A library that lacks an op the package calls (built before it existed) is not called into:
    # one warning naming the op and asking for a rebuild, and torch-op tables.
    for name in ("MCP_REQUIRE_EXTENSION", "MCP_DISABLE_EXTENSION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_extension, "_host_state", None)
    monkeypatch.setattr(_extension, "_import_host_module", _import_host_module)
    monkeypatch.setattr(_extension, "_HOST_OPS", (*_extension._HOST_OPS, "no_such_op"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _extension.host_tables() is None
    assert [type(w.message) for w in caught] == [RuntimeWarning]
    assert "built from older sources (no no_such_op)" in str(caught[0].message)
    assert "rebuild" in str(caught[0].message)
    monkeypatch.undo()
    assert _extension.host_tables() is not None
