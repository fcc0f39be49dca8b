"""Layer 2, the model: GPT, the attention dispatch, the FLOP count."""
