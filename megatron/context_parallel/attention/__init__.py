"""Attention under any CP plan: megatron layer modules, rotary at source positions, the
run / blocked tables, the fused Functions and their kernels, and the dense path."""
