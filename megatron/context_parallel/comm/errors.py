"""Input errors that every rank of a process group raises alike.

A rank that finds bad input in a collective call cannot simply raise: its peers would wait in
the collective for it. The package's entry points therefore check their input locally first,
turn any problem into an ``InputError`` (a kind, up to four integers and an optional note),
exchange every rank's verdict in one small collective (``groups.agree``) and then raise the first
bad rank's error on every rank, the bad rank included. The kind, the numbers and the note travel,
so every rank formats the same message. An exception that has no kind of its own (any other
``ValueError``, a ``RuntimeError``, ...) travels as ``rejected`` with its type and text as the
note.

This module holds the kinds and the exception; it does no communication.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

__all__ = ["InputError", "InputTypeError", "KINDS", "make", "from_code", "from_exception"]

# kind -> (code, message template over the numbers {0}..{3}). Codes travel between ranks as
# int64, so they must never be reused for another meaning; 0 means "no problem".
KINDS: Dict[str, Tuple[int, str]] = {
    # The call's structure.
    "not_a_plan": (1, "plan must be a ContextParallelPlan"),
    "group_size": (2, "the process group has {0} ranks but the plan has cp_size {1}"),
    "structure": (3, "expected a tensor or a dict / tuple / list of tensors"),
    "no_fields": (4, "nothing to move: the structure holds no tensors"),
    "not_a_tensor": (5, "field {0} is not a tensor"),
    "seq_dim": (6, "seq_dim {0} is out of range for field {1} with {2} dims"),
    "devices": (7, "fields are on different devices: field 0 and field {0}"),
    "backend_device": (8, "the group's backend moves CUDA tensors only, but the fields are not"),
    "rows": (9, "field {0} has {1} rows along seq_dim but the plan gives CP rank {3} {2} rows"),
    "full_rows": (10, "the full tensor has {0} rows along seq_dim but the plan's seq_len is {1}"),
    # The output head.
    "unknown_field": (
        20,
        "unknown output field (fields are hidden_states, target_logprobs, " "top_k, logits)",
    ),
    "top_k": (21, "top_k must be an int in [1, {1}] (the vocabulary), got {0}"),
    "chunk_size": (22, "chunk_size must be a positive int, got {0}"),
    "labels_missing": (23, "'target_logprobs' needs labels ([seq_len] ids in source order)"),
    "labels_dtype": (24, "labels must hold integer ids"),
    "labels_shape": (25, "labels must be [seq_len] = [{1}] in source order, got {0} positions"),
    "hidden_shape": (26, "hidden rows must be [n, H] or [n, 1, H], got {0} dims (dim 1 = {1})"),
    "weight_shape": (27, "output_weight must be [V/TP, H] with H = {1}, got [{0}, {2}]"),
    "hidden_rows": (28, "CP rank {2} has {0} hidden rows but the plan gives it {1}"),
    "option": (29, "bad output option (see OutputOptions)"),
    # Disagreements found by comparing ranks (the numbers say where).
    "plans_differ": (
        40,
        "ranks of the group use different plans (seq_len {0} vs {1}, cp_size "
        "{2} vs {3}, or the same sizes with other positions)",
    ),
    "fields_differ": (
        41,
        "ranks pass fields of different structure, dtypes or trailing shapes "
        "({0} vs {1} fields, {2} vs {3} bytes per row)",
    ),
    "calls_differ": (
        42,
        "ranks of the group made different calls (value {0} of the call's "
        "description: {1} vs {2})",
    ),
    # A rank raised something this module has no kind for; the note carries its type and text
    # (the bad rank's traceback has it as the InputError's __cause__).
    "rejected": (60, "input rejected"),
    "rejected_type": (61, "input rejected"),
}

_BY_CODE = {code: (kind, template) for kind, (code, template) in KINDS.items()}
_TYPE_KINDS = {"not_a_plan", "structure", "not_a_tensor", "rejected_type"}


class InputError(ValueError):
    """Bad input, raised with the same message on every rank of the group(s) of the call.

    Attributes:
        kind: a key of ``KINDS``.
        numbers: up to four ints, filled into the kind's message.
        origin: the global rank whose input was bad (None before ranks have agreed).
    """

    def __init__(self, kind: str, *numbers: int, origin: Optional[int] = None, note: str = ""):
        if kind not in KINDS:
            raise KeyError(f"unknown InputError kind {kind!r}")
        if len(numbers) > 4:
            raise ValueError(f"an InputError carries at most 4 numbers, got {len(numbers)}")
        self.kind = kind
        self.numbers = tuple(int(n) for n in numbers)
        self.origin = origin
        self.note = note
        text = KINDS[kind][1].format(*self.numbers, *([0] * (4 - len(self.numbers))))
        where = "" if origin is None else f"rank {origin}: "
        super().__init__(where + text + (f" ({note})" if note else ""))

    @property
    def code(self) -> int:
        return KINDS[self.kind][0]

    def header(self) -> Tuple[int, ...]:
        """``(code, n0, n1, n2, n3)``: what travels to the other ranks."""
        return (self.code,) + self.numbers + (0,) * (4 - len(self.numbers))


class InputTypeError(InputError, TypeError):
    """An ``InputError`` about an argument's type; ``except TypeError`` catches it too."""


def make(kind: str, *numbers: int, origin: Optional[int] = None, note: str = "") -> InputError:
    """An ``InputError`` of ``kind``, typed ``InputTypeError`` for the type kinds."""
    cls = InputTypeError if kind in _TYPE_KINDS else InputError
    return cls(kind, *numbers, origin=origin, note=note)


def from_code(code: int, numbers: Sequence[int], origin: int, note: str = "") -> InputError:
    """Rebuilds the error a rank found from its exchanged code, numbers and note."""
    kind = _BY_CODE[code][0] if code in _BY_CODE else "rejected"
    return make(kind, *list(numbers)[:4], origin=origin, note=note)


def from_exception(exc: BaseException) -> InputError:
    """``exc`` as an ``InputError``: itself when it is one, else ``rejected`` (``rejected_type``
    for a ``TypeError``) with its type and text as the note."""
    if isinstance(exc, InputError):
        return exc
    kind = "rejected_type" if isinstance(exc, TypeError) else "rejected"
    return make(kind, note=f"{type(exc).__name__}: {exc}")
