"""Errors that say whose fault they are.

A worker raises one of these (they cross Ray as the cause of its task error, and Ray re-raises
them as instances of the same class at the caller); the router decides from the type alone:

- `RequestError`: the request's own fault (a bad field, a prompt the worker can never hold). It
  reaches the client with its gRPC status code and never changes the worker's health.
- `WorkerBusy`: the worker is healthy but cannot take this request now (its KV pool is full).
  The router routes elsewhere or waits and retries, within the request's deadline.

Anything else from a worker call is the worker's fault; only a dead or restarted worker is
routed around (`router/health.py` judges that from Ray's liveness, not from the error).
"""
from __future__ import annotations


class RequestError(ValueError):
    """The request cannot be served as asked; `code` is the gRPC status name."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.code = code

    def __reduce__(self):   # keeps `code` across Ray's pickling of task errors
        return (type(self), (str(self), self.code))


class WorkerBusy(RuntimeError):
    """A healthy worker declined a request for now (backpressure): try another, or again later."""

    def __reduce__(self):
        return (type(self), (str(self),))


def error_message(exc: BaseException) -> str:
    """What to tell a client about a worker's error: the original message, without the traceback
    that Ray's task error wraps around it."""
    cause = getattr(exc, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else exc).strip()
    return text.splitlines()[-1][:500] if text else type(exc).__name__
