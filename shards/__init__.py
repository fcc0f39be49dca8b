"""Layer 2, the data: the shard format and the distributed token loader."""
