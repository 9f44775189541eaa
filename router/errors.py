"""The router's request errors, below the modules that raise them (`validation.py`,
`structured.py`) and those that answer them (the gRPC and HTTP servers)."""
from __future__ import annotations


class ValidationError(ValueError):
    """A field of a request that cannot be served: `field` names it (INVALID_ARGUMENT / 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
