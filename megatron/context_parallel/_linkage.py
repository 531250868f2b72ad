"""How the CUDA extension links the C++ runtime: the linker flags ``setup.py`` adds, and a check.

The extension must share the process's ``libstdc++.so`` (the one torch loaded). A toolchain that
links the C++ runtime statically (``-static-libstdc++``, as the GPU machines' default
``CXX=/opt/gcc/bin/g++`` does) gives the extension its own copy of the stream and locale code; a
failing ``TORCH_CHECK`` then formats its message with that copy and the process crashes
(SIGSEGV) instead of raising ``RuntimeError``. ``LINK_ARGS`` names ``libstdc++`` on the link
line ahead of the driver's own runtime libraries, kept even under ``--as-needed``: the linker
then resolves the C++ symbols from ``libstdc++.so``, and a static archive the driver appends
afterwards has nothing left to contribute. ``check_shared_runtime`` reads the built library's
``DT_NEEDED`` entries and refuses a build that still lacks ``libstdc++.so``.

Loaded by path from ``setup.py`` (the package is not importable while it builds): standard
library only.
"""

from __future__ import annotations

import os
import struct
from typing import List

__all__ = ["LINK_ARGS", "needed_libraries", "check_shared_runtime"]

LINK_ARGS = ["-Wl,--push-state,--no-as-needed", "-lstdc++", "-Wl,--pop-state"]

# ELF constants (System V ABI).
_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB = 0, 1, 5


def needed_libraries(path: str) -> List[str]:
    """The ``DT_NEEDED`` entries (sonames) of the ELF shared library at ``path``, in order.

    Reads the file's program headers, its dynamic section and string table; 64- and 32-bit,
    either byte order.

    Raises:
        ValueError: ``path`` is not an ELF file, or has no dynamic section.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path} is not an ELF file")
    wide = data[4] == 2
    end = "<" if data[5] == 1 else ">"
    if wide:
        (phoff,) = struct.unpack_from(end + "Q", data, 0x20)
        phentsize, phnum = struct.unpack_from(end + "HH", data, 0x36)
        phdr, dyn = end + "IIQQQQQQ", end + "qQ"
    else:
        (phoff,) = struct.unpack_from(end + "I", data, 0x1C)
        phentsize, phnum = struct.unpack_from(end + "HH", data, 0x2A)
        phdr, dyn = end + "IIIIIIII", end + "iI"
    loads, dynamic = [], None
    for i in range(phnum):
        fields = struct.unpack_from(phdr, data, phoff + i * phentsize)
        if wide:
            kind, offset, vaddr, filesz = fields[0], fields[2], fields[3], fields[5]
        else:
            kind, offset, vaddr, filesz = fields[0], fields[1], fields[2], fields[4]
        if kind == _PT_LOAD:
            loads.append((vaddr, offset, filesz))
        elif kind == _PT_DYNAMIC:
            dynamic = (offset, filesz)
    if dynamic is None:
        raise ValueError(f"{path} has no dynamic section")
    entries, step = [], struct.calcsize(dyn)
    for at in range(dynamic[0], dynamic[0] + dynamic[1], step):
        tag, value = struct.unpack_from(dyn, data, at)
        if tag == _DT_NULL:
            break
        entries.append((tag, value))
    strtab = next(v for t, v in entries if t == _DT_STRTAB)
    # The string table is addressed by its load address: find the file offset behind it.
    base = next(o + strtab - v for v, o, n in loads if v <= strtab < v + n)
    names = []
    for tag, value in entries:
        if tag == _DT_NEEDED:
            start = base + value
            names.append(data[start : data.index(b"\0", start)].decode())
    return names


def check_shared_runtime(path: str) -> None:
    """Raises unless the library at ``path`` needs the shared ``libstdc++.so``.

    Raises:
        RuntimeError: naming the libraries it needs, the compiler and the fix.
    """
    needed = needed_libraries(path)
    if any(name.startswith("libstdc++.so") for name in needed):
        return
    compiler = os.environ.get("CXX", "the default c++")
    raise RuntimeError(
        f"{os.path.basename(path)} was linked without libstdc++.so (it needs only {needed}): "
        f"{compiler} links the C++ runtime statically, and a failing TORCH_CHECK in the "
        "extension would then crash the process instead of raising. Build with a compiler "
        "that links libstdc++.so, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc, or skip the "
        "extension with MCP_SKIP_CUDA_BUILD=1"
    )
