"""Drafters on rank 0: any transformers causal LM directory or GGUF file with its own tokenizer,
with a KV cache of sequence slots that roll back (`load.load_drafter`).

    load.py      load_drafter: the fast drafter (llama / qwen2 / qwen3) or transformers
    cache.py     the fast drafter's converted checkpoint, made once beside its source
    weights.py   its weights in the compiled step's layout: from a runtime model, NVFP4, saved, loaded
    network.py   DraftNetwork: the weights, the slotted KV cache, batched forwards (kernels/drafter_step.py)
    slots.py     which slots are in use and how long each one is
    fast.py      FastDraftModel: the single-sequence protocol (model.py) over one slot
    hf.py        transformers drafters, one cache per slot
    model.py     the protocol the proposers use; trees for SLRS
    threads.py   the drafter's thread count, measured
"""
