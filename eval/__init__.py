"""Evaluation: byte LUTs (bpb), the sliding-window engine (sliding) and the roundtrip eval on it
(roundtrip), all bundled; tokenizer loading and stream byte counts for tools/CLI (offline, not
bundled); CLI in __main__. The shard format is shards/format.py."""
