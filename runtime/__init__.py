"""Target models, checkpoints, drafters, speculative decoding and the round driver."""
