"""Layer 3, the kit: what the package has and the packed record script does not (the bundler, checkpoints)."""
