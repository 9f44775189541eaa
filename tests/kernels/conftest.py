"""Kernel tests run the Triton kernels on CPU through the interpreter. The variable must be set
before `kernels` is imported: triton decides interpreted-or-compiled when a kernel is decorated."""
import importlib.util
import os

os.environ["TRITON_INTERPRET"] = "1"

if importlib.util.find_spec("triton") is None:   # install the `kernels` extra to run these
    collect_ignore_glob = ["test_*.py"]
