"""Drafters on rank 0: any transformers causal LM directory or GGUF file with its own tokenizer,
with a KV cache that rolls back (`load.load_drafter`)."""
