"""megatron-core integration: batch preparation and the forward of GPTModel / HybridModel."""
