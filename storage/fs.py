"""fsspec access: one place that opens a root URL, writes atomically, lists freshly and translates errors.

Atomic writes: readers never see a partial file. On a local disk the bytes go to a temporary file
``.<name>.tmp-<hex>`` in the same folder, are fsync'ed, then ``os.replace``d over the target. On S3
one PUT (or one completed multipart upload) makes the object appear whole. Listings skip the
temporary files a crash may leave behind.

Credentials and the endpoint come from the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``) or from ``storage_options``. Errors from fsspec,
s3fs and botocore become :class:`StorageError` naming the URL and the cause; known secret values are
redacted from every message.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.implementations.local import LocalFileSystem

from storage.errors import AlreadyExistsError, NotFoundError, StorageError
from storage.names import is_temp_name

CHUNK = 4 * 2**20
# The schemes whose guarantees this module provides (atomic and exclusive writes, fresh listings).
SCHEMES = ("file", "s3", "s3a")
_BUCKET_RE = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")  # botocore's check, run before any request
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_SECRET_OPTION_WORDS = ("secret", "token", "password", "key")


def normalize_root(root: str) -> str:
    """Strip trailing slashes; make a plain local path absolute; lower-case a URL's scheme.

    A root is a local folder, ``file://PATH`` or ``s3://BUCKET[/PREFIX]`` (:data:`SCHEMES`); anything
    else raises StorageError naming what is wrong.
    """
    if not isinstance(root, (str, os.PathLike)) or not str(root).strip():
        raise StorageError(f"invalid storage root {root!r}: expected a folder path or a URL like s3://bucket/prefix")
    root = os.fspath(root)
    if any(ord(c) < 32 or ord(c) == 127 for c in root):
        raise StorageError(f"invalid storage root {root!r}: control characters (NUL, newline, ...) are not allowed")
    if "://" in root:
        scheme, rest = root.split("://", 1)
        if scheme.lower() not in SCHEMES:
            raise StorageError(
                f"invalid storage root {root!r}: scheme {scheme!r} is not supported; use a local folder, "
                f"file://PATH or s3://BUCKET/PREFIX"
            )
        root = f"{scheme.lower()}://{rest}"
        bucket = rest.split("/", 1)[0]
        if scheme.lower() != "file" and bucket and not _BUCKET_RE.fullmatch(bucket):
            raise StorageError(
                f"invalid storage root {root!r}: bucket name {bucket!r} may hold only letters, digits, '.', '-' and '_'"
            )
    else:
        root = os.path.abspath(os.path.expanduser(root))
    stripped = root.rstrip("/")
    if not stripped:
        return "/"
    if stripped.endswith(":"):
        raise StorageError(f"invalid storage root {root!r}: a URL needs a bucket or folder after '://'")
    return stripped


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_local(path: str) -> tuple[str, int]:
    """sha256 hex and size of a local file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _secrets_of(options: Any) -> list[str]:
    found: list[str] = []
    if isinstance(options, dict):
        for k, v in options.items():
            if isinstance(v, str) and any(w in str(k).lower() for w in _SECRET_OPTION_WORDS):
                found.append(v)
            elif isinstance(v, dict):
                found.extend(_secrets_of(v))
    return found


class Location:
    """A root URL opened through fsspec; paths passed to its methods are relative to the root."""

    def __init__(self, root: str, storage_options: dict | None = None):
        self.url = normalize_root(root)
        options = dict(storage_options or {})
        self.protocol = self.url.split("://", 1)[0] if "://" in self.url else "file"
        if self.protocol in ("s3", "s3a") and "endpoint_url" not in options and os.environ.get("AWS_ENDPOINT_URL"):
            # explicit, so the fsspec instance cache keys on the endpoint
            options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
        self._secrets = [s for s in _secrets_of(options) + [os.environ.get(e, "") for e in _SECRET_ENV] if len(s) >= 4]
        self.is_s3 = self.protocol in ("s3", "s3a")
        self.is_local = self.protocol == "file"
        self._root_checked = False
        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.url, **options)
        except Exception as exc:  # noqa: BLE001 - bad options
            raise StorageError(self.redact(f"cannot open storage root {self.url}: {self._cause(exc)}")) from None
        self.path = self.path.rstrip("/") if self.path not in ("", "/") else self.path
        self.is_local = isinstance(self.fs, LocalFileSystem)

    # ---- naming -------------------------------------------------------------------------
    def full(self, rel: str) -> str:
        return f"{self.path.rstrip('/')}/{rel}" if rel else self.path

    def url_of(self, rel: str) -> str:
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    def rel_of(self, full_path: str, base_rel: str = "") -> str:
        """Path relative to ``base_rel`` of an fs path returned by a listing."""
        base = self.full(base_rel).rstrip("/")
        full_path = full_path.rstrip("/")
        if self.is_local:
            full_path = self.fs._strip_protocol(full_path)
        return full_path[len(base) + 1 :] if full_path.startswith(base + "/") else full_path

    # ---- errors ----------------------------------------------------------------------------
    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _cause(self, exc: BaseException) -> str:
        name = type(exc).__name__
        text = " ".join(str(exc).split()) or name  # one line, whatever the backend's message looks like
        low = text.lower()
        if self.is_s3 and "bucket does not exist" in low:
            return f"bucket {self.bucket!r} does not exist"
        if isinstance(exc, PermissionError) or "accessdenied" in low or "forbidden" in low:
            return f"access denied, check the credentials and their rights ({name}: {text})"
        if name == "NoCredentialsError":
            return "no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or pass storage_options)"
        if "could not connect" in low or "connect" in name.lower() or isinstance(exc, ConnectionError):
            return f"cannot reach the storage endpoint ({name}: {text})"
        return f"{name}: {text}"

    def error(self, action: str, rel: str, exc: BaseException) -> StorageError:
        """Translate an fsspec/s3fs/botocore exception into a StorageError naming the URL and the cause."""
        if isinstance(exc, StorageError):
            return exc
        url = self.url_of(rel)
        if isinstance(exc, NotADirectoryError) and self.is_local and (blocker := self._file_in_the_way(rel)):
            return StorageError(f"cannot {action} {url}: {blocker} is a file, not a folder")
        if isinstance(exc, FileNotFoundError) and not (self.is_s3 and "bucket does not exist" in str(exc).lower()):
            return NotFoundError(self.redact(f"cannot {action} {url}: it does not exist"))
        return StorageError(self.redact(f"cannot {action} {url}: {self._cause(exc)}"))

    @contextmanager
    def wrap(self, action: str, rel: str) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - every backend error becomes a StorageError
            raise self.error(action, rel, exc) from None

    @property
    def bucket(self) -> str:
        return self.path.split("/", 1)[0]

    def _file_in_the_way(self, rel: str = "") -> str | None:
        """Local: the first component of the path to ``rel`` that is a file, not a folder (None if none is)."""
        target = self.fs._strip_protocol(self.full(rel)).rstrip("/") or "/"
        parts = target.split("/")
        for end in range(2, len(parts) + 1):
            prefix = "/".join(parts[:end])
            try:  # one stat: an isdir-then-exists pair misreads a folder another writer creates in between
                mode = os.stat(prefix).st_mode
            except OSError:
                return None
            if not stat.S_ISDIR(mode):
                return prefix
        return None

    def check_root(self) -> None:
        """After a 'not found', make sure it is not the root that is missing or blocked (checked once).

        S3: the bucket must exist. The probe lists at most one key under the root's prefix; a policy that
        forbids even that cannot tell, so an access-denied probe is let pass (the 'not found' stands).
        Local: no component of the root's path may be a file (then nothing under it can exist).
        """
        if self._root_checked:
            return
        if self.is_local:
            if blocker := self._file_in_the_way():
                raise StorageError(f"cannot use storage root {self.url}: {blocker} is a file, not a folder")
            self._root_checked = True
            return
        if not self.is_s3:
            return
        prefix = self.path.split("/", 1)[1] + "/" if "/" in self.path else ""
        try:
            with self.wrap("access", ""):
                self.fs.call_s3("list_objects_v2", Bucket=self.bucket, Prefix=prefix, MaxKeys=1)
        except StorageError as exc:
            if not isinstance(exc.__context__, PermissionError) and "access denied" not in str(exc):
                raise
        self._root_checked = True

    def _not_found(self, action: str, rel: str) -> NotFoundError:
        self.check_root()
        return NotFoundError(f"cannot {action} {self.url_of(rel)}: it does not exist")

    # ---- writes ----------------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes, exclusive: bool = False) -> None:
        """Atomic write (see module docstring). ``exclusive``: raise AlreadyExistsError if the file exists
        (S3: a conditional PUT, ``If-None-Match: *``; local: a hard link, which never replaces)."""
        with self.wrap("write", rel):
            if self.is_local:
                self._local_atomic(rel, lambda f: f.write(data), exclusive)
            elif exclusive:
                try:
                    self.fs.pipe_file(self.full(rel), data, mode="create")
                except FileExistsError:
                    raise AlreadyExistsError(f"cannot create {self.url_of(rel)}: it already exists") from None
            else:
                self.fs.pipe_file(self.full(rel), data)

    def write_file(self, rel: str, local_path: str) -> None:
        """Atomic upload of a local file, streamed."""
        with self.wrap("write", rel):
            if self.is_local:
                def copy(f):
                    with open(local_path, "rb") as src:
                        shutil.copyfileobj(src, f, CHUNK)
                self._local_atomic(rel, copy)
            else:
                self.fs.put_file(local_path, self.full(rel))

    def _local_atomic(self, rel: str, fill, exclusive: bool = False) -> None:
        target = self.fs._strip_protocol(self.full(rel))
        folder, name = os.path.split(target)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                try:
                    os.link(tmp, target)  # never replaces an existing file
                except FileExistsError:
                    raise AlreadyExistsError(f"cannot create {self.url_of(rel)}: it already exists") from None
                os.unlink(tmp)
            else:
                os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def move(self, rel: str, new_rel: str) -> None:
        """Move a file to a new name (local: one rename; S3: copy, then delete). NotFoundError if it is gone."""
        try:
            with self.wrap("move", rel):
                if self.is_local:
                    os.rename(self.fs._strip_protocol(self.full(rel)), self.fs._strip_protocol(self.full(new_rel)))
                else:
                    self.fs.copy(self.full(rel), self.full(new_rel))
                    self.fs.rm_file(self.full(rel))
                    self.fs.invalidate_cache(self.path)
        except NotFoundError:
            raise self._not_found("move", rel) from None

    def delete(self, rels: list[str]) -> None:
        for rel in rels:
            with self.wrap("delete", rel):
                try:
                    self.fs.rm_file(self.full(rel))
                except FileNotFoundError:
                    pass
        if rels and not self.is_local:
            self.fs.invalidate_cache(self.path)

    # ---- reads -----------------------------------------------------------------------------
    def read_bytes(self, rel: str, small: bool = False) -> bytes:
        """Read a whole file. ``small`` (manifests, configs): on S3 one GET, without the size probe."""
        kwargs = {"max_concurrency": 1} if small and self.is_s3 else {}
        try:
            with self.wrap("read", rel):
                return self.fs.cat_file(self.full(rel), **kwargs)
        except NotFoundError:
            raise self._not_found("read", rel) from None

    def read_many(self, rels: list[str]) -> dict[str, bytes | StorageError]:
        """Read several files at once (concurrently on S3); each value is the bytes or the error."""
        fulls = [self.full(r) for r in rels]
        with self.wrap("read", rels[0].rsplit("/", 1)[0] if rels else ""):
            if isinstance(self.fs, AsyncFileSystem):
                async def gather() -> list:
                    out: list = []
                    for i in range(0, len(fulls), 64):
                        kwargs = {"max_concurrency": 1} if self.is_s3 else {}  # small files: one GET each
                        batch = [self.fs._cat_file(f, **kwargs) for f in fulls[i : i + 64]]
                        out += await asyncio.gather(*batch, return_exceptions=True)
                    return out

                values = sync(self.fs.loop, gather)
            else:
                values = []
                for full in fulls:
                    try:
                        values.append(self.fs.cat_file(full))
                    except Exception as exc:  # noqa: BLE001 - reported per file below
                        values.append(exc)
        out: dict[str, bytes | StorageError] = {}
        for rel, value in zip(rels, values):
            out[rel] = bytes(value) if isinstance(value, (bytes, bytearray)) else self.error("read", rel, value)
        if any(isinstance(v, NotFoundError) for v in out.values()):
            self.check_root()
        return out

    def download(self, rel: str, local_path: str) -> None:
        try:
            with self.wrap("read", rel):
                self.fs.get_file(self.full(rel), local_path)
        except NotFoundError:
            raise self._not_found("read", rel) from None

    def hash_remote(self, rel: str) -> tuple[str, int]:
        """sha256 hex and size of a stored file, streamed."""
        h, size = hashlib.sha256(), 0
        with self.wrap("read", rel):
            with self.fs.open(self.full(rel), "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    size += len(chunk)
        return h.hexdigest(), size

    def exists(self, rel: str) -> bool:
        with self.wrap("check", rel):
            if not self.is_local:
                self.fs.invalidate_cache(self.full(rel))
            try:  # not fs.isfile: it answers False to every error, wrong credentials included
                found = self.fs.info(self.full(rel)).get("type") == "file"
            except FileNotFoundError as exc:
                if self.is_s3 and "bucket does not exist" in str(exc).lower():
                    raise
                found = False
        if not found:
            self.check_root()
        return found

    # ---- listings (always fresh) -------------------------------------------------------------
    def find(self, rel_dir: str) -> dict[str, int]:
        """Every file under ``rel_dir`` (recursive) as {path relative to rel_dir: size}; temp files skipped."""
        base = self.full(rel_dir)
        with self.wrap("list", rel_dir):
            self.fs.invalidate_cache(base)
            try:
                found = self.fs.find(base, detail=True)
            except FileNotFoundError as exc:
                if self.is_s3 and "bucket does not exist" in str(exc).lower():
                    raise
                found = {}
        out: dict[str, int] = {}
        for full, info in found.items():
            if info.get("type") == "directory" or full.endswith("/"):
                continue
            rel = self.rel_of(full, rel_dir)
            if is_temp_name(rel.rsplit("/", 1)[-1]):
                continue
            out[rel] = int(info.get("size") or 0)
        if not out:
            self.check_root()
        return out

    def list_dirs(self, rel_dir: str) -> list[str]:
        """Names of the sub-folders directly under ``rel_dir`` ([] when it does not exist)."""
        base = self.full(rel_dir)
        with self.wrap("list", rel_dir):
            self.fs.invalidate_cache(base)
            try:
                entries = self.fs.ls(base, detail=True)
            except FileNotFoundError as exc:
                if self.is_s3 and "bucket does not exist" in str(exc).lower():
                    raise
                entries = []
        names = sorted(
            self.rel_of(e["name"], rel_dir) for e in entries if e.get("type") == "directory"
        )
        if not names:
            self.check_root()
        return [n for n in names if n and "/" not in n]

    def root_exists(self) -> bool:
        """Local: the root folder exists (StorageError if it, or a folder above it, is a file).
        S3: the bucket exists (a prefix always 'exists')."""
        if self.is_local:
            local = self.fs._strip_protocol(self.path)
            if os.path.isfile(local):
                raise StorageError(f"cannot use storage root {self.url}: it is a file, not a folder")
            self.check_root()
            return os.path.isdir(local)
        self.check_root()
        return True


def read_url(url: str, storage_options: dict | None = None) -> bytes:
    """The bytes of one file named by a local path, ``file://PATH`` or ``s3://BUCKET/KEY`` (:data:`SCHEMES`; any
    other scheme, ``http(s)://`` included, is refused by :func:`normalize_root`: nothing here fetches a URL a caller
    chose from the web)."""
    full = normalize_root(url)
    parent, _, name = full.rpartition("/")
    parent = parent or "/"
    if not name or parent.endswith(":/"):
        raise StorageError(f"invalid file {url!r}: expected a path to a file (a folder, or s3://BUCKET/KEY)")
    return Location(parent, storage_options).read_bytes(name)

