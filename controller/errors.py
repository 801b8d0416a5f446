"""Errors of the control plane: each says what was wrong and what to do."""

from __future__ import annotations


class ControlError(Exception):
    """Base of the controller's errors."""


class StateConflict(ControlError):
    """Another writer changed a model's desired state between our read and our write: read again."""


class TransitionError(ControlError):
    """A change of desired state that the current state does not allow (e.g. promote a failed version)."""


class RolloutError(ControlError):
    """A rollout that did not promote its version; the message says where and why."""


class NewerRecord(ControlError):
    """A desired state written by a newer controller: read, never overwritten (no downgrade)."""
