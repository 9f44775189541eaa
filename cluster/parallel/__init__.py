"""Tensor parallelism inside one worker: a process group among its ranks, sharded layers and the
step message rank 0 broadcasts to the others (README.md)."""
