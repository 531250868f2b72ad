"""``fused.select_backend``, the one dispatch point of the attention path, on the CPU.

cuDNN's availability is faked: ``cudnn._cudnn`` (what ``cudnn.available`` consults besides the
device) is patched to a stand-in module or to None, and a CUDA query is a ``meta`` tensor whose
``device`` reads ``cuda:0`` (``select_backend`` reads only the query's device and dtype). Every
combination of backend setting (``attention_settings(backend=...)``), availability, dtype, head
dim, batch and dropout is checked against the rule written out in ``_expected``:

* ``"dense"`` always runs dense, whatever the call (and never asks whether cuDNN is there);
* the fused path runs fp16 / bf16 CUDA queries with the frontend installed, head dims that are
  multiples of 8 up to 128, and one packed batch (``b == 1``); a call outside that goes dense
  under ``"auto"``, and under ``"cudnn"`` raises ``ValueError`` naming the reason;
* a call the fused path would run, with dropout > 0, raises (``"auto"`` and ``"cudnn"``): the
  fused path has no dropout.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron.context_parallel.attention import cudnn as cudnn_kernel
from megatron.context_parallel.attention import fused
from megatron.context_parallel.attention.settings import (
    attention_settings,
    current_attention_settings,
)

HEADS = 4
SUPPORTED_DIMS = (8, 64, 80, 128)
UNSUPPORTED_DIMS = (100, 136, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# "cuda": a CUDA query and the frontend importable; "no frontend": a CUDA query, the frontend
# missing; "cpu": a CPU query with the frontend importable.
AVAILABILITY = ("cuda", "no frontend", "cpu")

# The reason each fault is named by, as the ValueError of a forced "cudnn" gives it.
_REASONS = {
    "unavailable": "it needs a CUDA tensor and nvidia-cudnn-frontend",
    "dtype": "cuDNN's attention takes fp16 / bf16, not {dtype}",
    "head_dim": "head dim {head_dim} is not a multiple of 8 up to 128",
    "batch": "it takes one packed batch ([s, 1, ...]), got b = {batch}",
}


class _FakeCudaTensor(torch.Tensor):
    """A ``meta`` tensor that reports ``cuda:0`` as its device."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _query(where: str, dtype: torch.dtype, batch: int, head_dim: int) -> torch.Tensor:
    """A ``[s, b, H, d]`` query on a (faked) CUDA device or on the CPU."""
    if where == "cpu":
        return torch.empty(16, batch, HEADS, head_dim, dtype=dtype)
    meta = torch.empty(16, batch, HEADS, head_dim, dtype=dtype, device="meta")
    return torch.Tensor._make_subclass(_FakeCudaTensor, meta)


@pytest.fixture
def frontend(monkeypatch):
    """``frontend(installed)``: makes ``cudnn.available`` see the frontend (or not)."""

    def set_installed(installed: bool) -> None:
        stand_in = object() if installed else None
        monkeypatch.setattr(cudnn_kernel, "_cudnn", lambda: stand_in)

    return set_installed


def _expected(backend, where, dtype, head_dim, batch, dropout):
    """``("ok", name)`` or ``("raises", [message fragments, any of which it must contain])``."""
    if backend == "dense":
        return "ok", "dense"
    faults = []
    if where != "cuda":
        faults.append(_REASONS["unavailable"])
    if dtype not in (torch.float16, torch.bfloat16):
        faults.append(_REASONS["dtype"].format(dtype=dtype))
    if head_dim not in SUPPORTED_DIMS:
        faults.append(_REASONS["head_dim"].format(head_dim=head_dim))
    if batch != 1:
        faults.append(_REASONS["batch"].format(batch=batch))
    if faults:
        if backend == "auto":
            return "ok", "dense"
        return "raises", ["fused attention cannot run this call: " + f for f in faults]
    if dropout > 0:
        return "raises", [f"fused attention path has no dropout (attention_dropout = {dropout})"]
    return "ok", "cudnn"


_CALLS = list(
    itertools.product(
        ("auto", "cudnn", "dense"),
        AVAILABILITY,
        DTYPES,
        SUPPORTED_DIMS + UNSUPPORTED_DIMS,
        (1, 2),
        (0.0, 0.1),
    )
)


@pytest.mark.parametrize(
    "backend,where,dtype,head_dim,batch,dropout",
    _CALLS,
    ids=[
        f"{b}-{w.replace(' ', '_')}-{str(t).split('.')[1]}-d{d}-b{n}-p{p}"
        for b, w, t, d, n, p in _CALLS
    ],
)
def test_select_backend(frontend, backend, where, dtype, head_dim, batch, dropout):
    frontend(where != "no frontend")
    query = _query(where, dtype, batch, head_dim)
    kind, want = _expected(backend, where, dtype, head_dim, batch, dropout)
    with attention_settings(backend=backend):
        assert fused.attention_backend() == backend
        if kind == "ok":
            assert fused.select_backend(query, head_dim, batch, dropout) == want
        else:
            with pytest.raises(ValueError) as info:
                fused.select_backend(query, head_dim, batch, dropout)
            assert any(w in str(info.value) for w in want), (str(info.value), want)


def test_fault_cases_are_all_reached():
    # The grid above holds every outcome: each fault alone under "cudnn", the dropout refusal,
    # and both names.
    outcomes = {_expected(*call)[0] for call in _CALLS}
    names = {_expected(*call)[1] for call in _CALLS if _expected(*call)[0] == "ok"}
    assert outcomes == {"ok", "raises"} and names == {"dense", "cudnn"}
    base = ("cudnn", "cuda", torch.bfloat16, 128, 1, 0.0)
    singles = [
        ("where", 1, "cpu"),
        ("where", 1, "no frontend"),
        ("dtype", 2, torch.float32),
        ("head_dim", 3, 256),
        ("head_dim", 3, 136),
        ("batch", 4, 2),
    ]
    for _, index, value in singles:
        call = list(base)
        call[index] = value
        kind, want = _expected(*call)
        assert kind == "raises" and len(want) == 1, (call, want)


def test_dense_never_asks_for_cudnn(monkeypatch):
    # "dense" is the CPU install's path: it must not touch the frontend at all.
    def refuse(*_):
        raise AssertionError("select_backend asked for cuDNN under backend='dense'")

    monkeypatch.setattr(cudnn_kernel, "available", refuse)
    monkeypatch.setattr(cudnn_kernel, "_cudnn", refuse)
    with attention_settings(backend="dense"):
        query = _query("cuda", torch.bfloat16, 1, 128)
        assert fused.select_backend(query, 128, 1, 0.0) == "dense"


def test_cpu_install_goes_dense_without_faking():
    # On a CPU tensor the real availability check says no, whatever is installed: "auto" runs
    # dense (also with dropout, which the dense path implements), "cudnn" names the reason.
    query = torch.empty(8, 1, HEADS, 64, dtype=torch.bfloat16)
    assert current_attention_settings().backend == "auto"
    assert not cudnn_kernel.available(query.device)
    assert fused.select_backend(query, 64, 1, 0.0) == "dense"
    assert fused.select_backend(query, 64, 1, 0.5) == "dense"
    with attention_settings(backend="cudnn"):
        with pytest.raises(ValueError, match="needs a CUDA tensor and nvidia-cudnn-frontend"):
            fused.select_backend(query, 64, 1, 0.0)


def test_available_needs_both_cuda_and_the_frontend(frontend):
    frontend(True)
    assert cudnn_kernel.available(torch.device("cuda", 0))
    assert cudnn_kernel.available(torch.device("cuda"))
    assert not cudnn_kernel.available(torch.device("cpu"))
    assert not cudnn_kernel.available(torch.device("meta"))
    frontend(False)
    assert not cudnn_kernel.available(torch.device("cuda", 0))


def test_the_setting_is_scoped():
    # attention_settings restores the backend on exit, also when the call inside raises.
    query = _query("cpu", torch.float32, 1, 64)
    before = fused.attention_backend()
    with pytest.raises(ValueError):
        with attention_settings(backend="cudnn"):
            fused.select_backend(query, 64, 1, 0.0)
    assert fused.attention_backend() == before
    with pytest.raises(ValueError, match="attention backend must be one of"):
        with attention_settings(backend="flash"):
            pass
    assert fused.attention_backend() == before
