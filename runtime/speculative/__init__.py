"""Lossless speculative decoding: proposers (none, standard, slem, tli, slrs), the verifier
(rejection sampler), vocabulary mapping across tokenizers, adaptive draft length and `auto`.

The vocabulary used throughout (p, q, accepted / recovered / bonus tokens) is defined once, in
`verifier.py`. The round loop that drives all of this is `runtime/driver.py`.
"""
