"""Errors of the control plane: each says what was wrong and what to do.

The repository's own errors (a conflicting write, a refused transition, a newer record) are in
repository/errors.py; these are the controller's: a server that cannot be reached or refuses a
load, a rollout that did not promote.
"""

from __future__ import annotations


class ControlError(Exception):
    """Base of the controller's errors."""


class RolloutError(ControlError):
    """A rollout that did not promote its version; the message says where and why."""
