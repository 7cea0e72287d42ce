"""The exceptions of the kvedge package, declared once: the native module
raises these same classes (through ``status_error`` and ``unavailable``), and
so does the pure-Python JSON path.

Every error is a ``KvedgeError`` with the daemon's ``status`` name and its
``code`` number, both None when the daemon was not reached.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

from ._kvedge import status_code

__all__ = [
    "BadRequest",
    "DaemonUnavailable",
    "KvedgeError",
    "NoWorker",
    "Refused",
    "Rejected",
    "TooManyRequests",
    "UnknownRequest",
    "status_error",
    "unavailable",
]


class KvedgeError(Exception):
    """Base of every kvedge error. ``status`` is the daemon's status name and
    ``code`` its number (both None when the daemon was not reached)."""

    status: Optional[str]
    code: Optional[int]

    def __init__(self, message: str, status: Optional[str] = None, code: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class DaemonUnavailable(KvedgeError):
    """The daemon could not be reached or went away (connection refused,
    closed, timed out)."""


class BadRequest(KvedgeError):
    """The daemon refused the request as malformed."""


class NoWorker(KvedgeError):
    """No available worker serves the request's model and role."""


class Rejected(KvedgeError):
    """A rule found no candidate and rejects the request, or no rule matches
    it."""


class UnknownRequest(KvedgeError):
    """prefill_done or finish for a request id the daemon does not hold."""


class TooManyRequests(KvedgeError):
    """The daemon holds its maximum of selected, unfinished requests."""


class Refused(KvedgeError):
    """The daemon refused the connection or the request's shape (permissions,
    connection limit, frame size, protocol version)."""


# The statuses with an exception of their own; every other error status is
# Refused. The codes come from the native module (the protocol's one table).
_BY_STATUS: Dict[str, Type[KvedgeError]] = {
    "bad_request": BadRequest,
    "no_worker": NoWorker,
    "rejected": Rejected,
    "no_rule": Rejected,
    "unknown_request": UnknownRequest,
    "too_many_requests": TooManyRequests,
}


def status_error(status: str, message: str) -> KvedgeError:
    """The exception for the daemon's error status ``status`` (its name)."""
    return _BY_STATUS.get(status, Refused)(message, status, status_code(status))


def unavailable(message: str) -> DaemonUnavailable:
    """The exception for a daemon that could not be reached."""
    return DaemonUnavailable(message)
