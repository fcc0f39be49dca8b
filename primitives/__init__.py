"""Layer 1, the primitives: settings and env parsing, atomic files, progress, per-row quantization math."""
