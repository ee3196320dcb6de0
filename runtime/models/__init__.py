"""Tensor-parallel target models: parallel layers, KV cache, decoders, loader.

`load_model(source, ctx, ...)` builds a `TargetModel` for this rank's shard;
`TargetModel.forward(input_ids, positions)` appends to its KV cache and returns logits on
rank 0 of the group.
"""
