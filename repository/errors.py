"""Errors of the model repository: each says what was wrong and what to do.

RepositoryError
 +-- PublishError      a version cannot be published or read (exists, lock, not complete, bad store)
 +-- StateConflict     another writer changed a record or config since it was read: read again
 +-- TransitionError   a change of desired state the current state does not allow
 +-- NewerRecord       a record written by a newer skewserve: read, never overwritten
"""

from __future__ import annotations


class RepositoryError(Exception):
    """Base of the repository's errors."""


class PublishError(RepositoryError):
    """A version cannot be published or read: the message names the repository and the fix."""


class StateConflict(RepositoryError):
    """Another writer changed a model's desired state (or a config) between our read and our write."""


class TransitionError(RepositoryError):
    """A change of desired state that the current state does not allow (e.g. promote a failed version)."""


class NewerRecord(RepositoryError):
    """A desired state written by a newer controller: read, never overwritten (no downgrade)."""
