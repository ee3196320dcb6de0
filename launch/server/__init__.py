"""The HTTP face of `hetero-run serve` on rank 0: OpenAI-compatible routes over the engine protocol
(runtime/engine/api.py). Nothing here runs model code: requests go to the engine, events come back."""
