"""Where ``POST /v1/load_lora_adapter`` may read an adapter from: ``lora_path`` is checked against the server's
adapter roots before anything is opened or fetched, so a caller cannot make the server fetch a URL of its choosing
(SSRF) or read folders outside what the operator named.

The rule: ``lora_path`` is allowed when it lies under one of the roots.

- A local root (a folder, or ``file://FOLDER``) admits a local folder or a ``file://`` URI (host empty or
  ``localhost``) whose real path, symlinks resolved and ``..`` collapsed, is the root or inside it.
- A storage root ``s3://BUCKET[/PREFIX]`` admits ``s3://`` URIs of the same bucket whose key path starts with the
  prefix's segments; a URI with ``.`` or ``..`` or empty segments, a query, a fragment, or fsspec chaining (``::``)
  is refused rather than normalised.
- Any other scheme (``http``, ``https``, ``ftp``, ``memory``, …) is refused, whatever the roots.

Default roots: the trajflow cache (`backends.modeling.loading.cache_root()`), where the flow and `LocalBackend`
download the adapters they publish (`backends.policy.publish.local_adapter`). A caller adds its run storage with
``start_server(adapter_roots=...)`` or ``trajflow serve --adapter-root`` (repeatable).

Simplification: the check runs on the path as given; a symlink swapped between the check and the read is not
re-checked (the root's owner controls what links it holds).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from backends.inference.adapters import AdapterError

STORAGE_SCHEMES = ("s3",)


def _segments(path: str) -> list[str]:
    return [s for s in path.split("/") if s]


class AdapterSources:
    """The adapter roots of one server; `check(lora_path)` raises AdapterError naming why a path is refused."""

    def __init__(self, roots: list[str | os.PathLike]):
        self.local: list[Path] = []
        self.storage: list[tuple[str, str, list[str]]] = []  # (scheme, bucket, prefix segments)
        for root in roots:
            root = os.fspath(root)
            scheme = urlsplit(root).scheme.lower() if "://" in root else ""
            if scheme in ("", "file"):
                self.local.append(Path(os.path.realpath(self._local_path(root) if scheme else
                                                        os.path.expanduser(root))))
            elif scheme in STORAGE_SCHEMES:
                parts = urlsplit(root)
                if not parts.netloc:
                    raise ValueError(f"adapter root {root!r} names no bucket")
                self.storage.append((scheme, parts.netloc, _segments(parts.path)))
            else:
                raise ValueError(f"adapter root {root!r}: a root is a folder, file://FOLDER or "
                                 f"{'|'.join(s + '://BUCKET/PREFIX' for s in STORAGE_SCHEMES)}")

    @classmethod
    def default(cls, extra: list[str | os.PathLike] | None = None) -> AdapterSources:
        """The trajflow cache, plus `extra`."""
        from backends.modeling.loading import cache_root

        return cls([cache_root(), *(extra or [])])

    def describe(self) -> str:
        return ", ".join([str(p) for p in self.local] +
                         [f"{s}://{b}/{'/'.join(p)}".rstrip("/") for s, b, p in self.storage]) or "none"

    def check(self, lora_path: str) -> None:
        """Raise AdapterError unless `lora_path` lies under a root (module docstring)."""
        if "\x00" in lora_path or any(ord(c) < 32 for c in lora_path):
            raise AdapterError("lora_path contains control characters (NUL, newline, ...)")
        if "://" not in lora_path:
            return self._check_local(lora_path, Path(os.path.expanduser(lora_path)))
        parts = urlsplit(lora_path)
        scheme = parts.scheme.lower()
        if "::" in lora_path or parts.query or parts.fragment:
            raise AdapterError(f"lora_path {lora_path!r}: chained URLs, queries and fragments are not accepted")
        if scheme == "file":
            return self._check_local(lora_path, Path(self._local_path(lora_path)))
        if scheme not in STORAGE_SCHEMES:
            raise AdapterError(f"lora_path {lora_path!r}: the scheme {parts.scheme!r} is not allowed; this server "
                               f"loads adapters only from local folders and {', '.join(STORAGE_SCHEMES)}:// "
                               f"under its adapter roots ({self.describe()})")
        segments = parts.path.split("/")[1:]
        if segments and segments[-1] == "":
            segments = segments[:-1]  # one trailing slash names the same folder
        if any(s in ("", ".", "..") for s in segments):
            raise AdapterError(f"lora_path {lora_path!r}: empty, '.' or '..' path segments are not accepted")
        for root_scheme, bucket, prefix in self.storage:
            if root_scheme == scheme and parts.netloc == bucket and segments[: len(prefix)] == prefix:
                return None
        raise AdapterError(f"lora_path {lora_path!r} is outside this server's adapter roots ({self.describe()}); "
                           "start it with --adapter-root to allow another one")

    @staticmethod
    def _local_path(uri: str) -> str:
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise AdapterError(f"{uri!r}: a file:// URI must name this machine (empty host or localhost)")
        return unquote(parts.path)

    def _check_local(self, given: str, path: Path) -> None:
        real = Path(os.path.realpath(path))
        if not any(real == root or root in real.parents for root in self.local):
            raise AdapterError(f"lora_path {given!r} is outside this server's adapter roots ({self.describe()}); "
                               "start it with --adapter-root to allow another folder")
