"""The model side: inference servers, the GRPO trainer, and the ART-style backends.

`LocalBackend` / `RemoteBackend` are imported lazily so that `import backends` stays light.
"""

from typing import Any

__all__ = ["LocalBackend", "RemoteBackend"]


def __getattr__(name: str) -> Any:
    if name == "LocalBackend":
        from backends.art.local_backend import LocalBackend

        return LocalBackend
    if name == "RemoteBackend":
        from backends.art.remote_backend import RemoteBackend

        return RemoteBackend
    raise AttributeError(name)
