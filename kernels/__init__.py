"""Triton attention kernels for the paged KV cache, each beside a torch reference with the same
signature (kernels/reference.py). A leaf package: imports torch and triton only. See README.md."""
