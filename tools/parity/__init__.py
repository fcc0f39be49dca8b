"""The record-parity harness: a record's own train_gpt.py imported on a CPU with stand-ins for its GPU-only
parts (standins.py), its weights and settings mapped onto the kit's (parity_map.py, parity_config.py)."""
