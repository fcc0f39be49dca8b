"""Evaluation: byte LUTs and val_bpb (bpb), roundtrip and sliding-window evals, token shards; CLI in __main__."""
