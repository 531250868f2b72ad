"""Sequence mixers other than attention under any CP plan (Gated DeltaNet)."""
