"""The trainer's compile cache the flow uses: artifact blobs in the run's own storage, ``compile-cache/<key>.bin``.

It fulfils the ``ArtifactStore`` contract of :mod:`backends.training.compile_cache` (``get(key) -> bytes | None``,
``put(key, data)``). The cache sits at run level, not in a step: a fresh process on a fresh machine (a spot instance,
a restart) finds what an earlier update of the run compiled, whichever step it runs. Each put is the store's atomic
write (local: temp file, then rename; S3: one PUT), so a reader sees a whole file or the previous one, never a part.
"""

from __future__ import annotations

from storage.errors import NotFoundError
from storage.layout import compile_cache_file
from storage.store import RunStore


class StoreCompileCache:
    """Compile artifacts as files of the run: ``compile-cache/<key>.bin`` at run level."""

    def __init__(self, store: RunStore):
        self.store = store

    def get(self, key: str) -> bytes | None:
        try:
            return self.store.get_bytes(None, compile_cache_file(key))
        except NotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        self.store.put_bytes(None, compile_cache_file(key), data)

    def __repr__(self) -> str:
        return f"StoreCompileCache({self.store!r})"
