"""The output head: ForwardOutput, the vocab-parallel log-probs / top-k head and its kernels."""
