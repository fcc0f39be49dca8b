"""Datasets (`python tools/prepare_data.py`): text, tokenizer, shards, the sample, FineWeb downloads, staged writes."""
