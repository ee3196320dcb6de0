"""Command line, MPI bootstrap of torch.distributed, rank roles and shutdown."""
