"""Benchmarks (`python tools/bench_*.py`) and the CPU twins of the GPU paths (step, flash-attn, sizes)."""
