"""The extension's link against the shared C++ runtime (``_linkage``), on this machine's g++.

The GPU machines' default compiler links the C++ runtime statically, which turned a failing
``TORCH_CHECK`` into a segfault. Reproduced here with ``-static-libstdc++``: a small C++ shared
library that formats an integer into a stream, linked as that compiler does, needs no
``libstdc++.so`` and exports its own copy of the stream code; with ``LINK_ARGS`` (what
``setup.py`` adds) it needs ``libstdc++.so`` and carries no copy, and ``check_shared_runtime``
tells the two apart. The GPU side (a bad call into the built extension raises
``RuntimeError``) is ``tests/comm/test_row_ops_cuda.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from megatron.context_parallel._linkage import LINK_ARGS, check_shared_runtime, needed_libraries

_SOURCE = """
#include <sstream>
#include <string>
std::string describe(int rows) { std::ostringstream s; s << rows << " rows"; return s.str(); }
"""


def _link(tmp_path, name, extra):
    source = tmp_path / "x.cpp"
    source.write_text(_SOURCE)
    out = tmp_path / name
    cmd = ["g++", "-shared", "-fPIC", "-static-libstdc++", str(source), "-o", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"this g++ cannot link -static-libstdc++: {proc.stderr[-500:]}")
    return str(out)


def _exports_stream_code(path):
    symbols = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True)
    return "_ZNSo" in symbols.stdout  # std::ostream members


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None, reason="no g++")
def test_link_args_keep_the_shared_runtime_under_a_static_default(tmp_path):
    static = _link(tmp_path, "static.so", [])
    shared = _link(tmp_path, "shared.so", LINK_ARGS)
    assert not any(n.startswith("libstdc++.so") for n in needed_libraries(static))
    assert _exports_stream_code(static)  # its own copy of the stream code
    assert "libstdc++.so.6" in needed_libraries(shared)
    assert not _exports_stream_code(shared)
    check_shared_runtime(shared)
    with pytest.raises(RuntimeError, match=r"linked without libstdc\+\+\.so.*CXX=/usr/bin/g\+\+"):
        check_shared_runtime(static)


def test_needed_libraries_reads_torch_and_refuses_non_elf(tmp_path):
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    needed = needed_libraries(lib)
    assert "libstdc++.so.6" in needed and "libc.so.6" in needed
    text = tmp_path / "not_elf.so"
    text.write_text("no")
    with pytest.raises(ValueError, match="not an ELF file"):
        needed_libraries(str(text))
