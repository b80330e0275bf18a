"""Storage errors. Every message names the full URL or path concerned and the cause, never a secret."""

from __future__ import annotations


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URL and the cause."""


class NotFoundError(StorageError):
    """The file or step asked for does not exist (the bucket does; a missing bucket is a plain StorageError)."""


class AlreadyExistsError(StorageError):
    """An exclusive create found the file already there (e.g. another writer committed the step first)."""


class CorruptManifestError(NotFoundError):
    """A step manifest exists but cannot be parsed or validated: the step is not committed.

    A NotFoundError, so every reader treats the step as uncommitted. ``removed``: the corrupt file is no
    longer at ``manifest.json`` (the store moved it aside); False when it could not be moved.
    """

    def __init__(self, message: str, removed: bool = False):
        super().__init__(message)
        self.removed = removed


class HashMismatchError(StorageError):
    """A stored file's content differs from the sha256 recorded in its step manifest."""
