"""graphtap's graph-baked ops: torch custom ops, a torch reference (CPU, and the spec of
truth in tests) and a Triton kernel (GPU) side by side per op family."""
