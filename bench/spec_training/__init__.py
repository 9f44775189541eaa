"""Training code for the built-in default model (``stdlib-coder`` and its drafts).

Everything here is trained on CPU from the Python standard library's own source,
located at run time via ``sysconfig``; nothing is downloaded. See README.md for
the exact commands used to produce ``cluster/model/weights/`` (and ``weights/`` here: the
data-only draft, a training baseline that is not shipped). Tooling: not part of the package.
"""
