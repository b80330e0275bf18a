"""S3 fixtures: moto's S3 server on 127.0.0.1 (ephemeral port), started once per session.

- ``moto_endpoint`` (session): the server's URL; sets no environment.
- ``s3_endpoint``: the same URL, with AWS_ENDPOINT_URL, dummy keys and AWS_DEFAULT_REGION set for
  the test (production code needs no endpoint plumbing).
- ``s3_bucket``: a fresh bucket per test (the server is never reset, so other session fixtures' buckets survive).
- ``store_root``: parametrized ["local", "s3"]: a fresh storage root per test.
- ``s3_iam_user``: a moto IAM user with full S3 rights, and moto's signature checking switched on
  for the test (switched off again afterwards).
- ``raw_storage``: out-of-band reads and writes under ``store_root``.
- ``storage_writes``: every write, move and delete that reaches storage under ``store_root``, in order.
- ``adapter_src``: a local folder shaped like an adapter (a config and 200 kB of random weights) to upload.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.request
import uuid

import pytest

DUMMY_KEY = "testing-key-id"
DUMMY_SECRET = "testing-secret-value"


@pytest.fixture(scope="session")
def moto_endpoint():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_endpoint(moto_endpoint, monkeypatch, tmp_path):
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DUMMY_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", DUMMY_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    return moto_endpoint


def _boto_client(service: str, endpoint: str, key: str = DUMMY_KEY, secret: str = DUMMY_SECRET):
    import boto3

    return boto3.client(
        service, endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key, aws_secret_access_key=secret
    )


@pytest.fixture(scope="session")
def _moto_s3_client(moto_endpoint):
    return _boto_client("s3", moto_endpoint)  # explicit endpoint and keys: independent of the environment


@pytest.fixture
def s3_client(s3_endpoint, _moto_s3_client):
    """A plain boto3 S3 client on the moto server, for out-of-band reads and writes in tests."""
    return _moto_s3_client


@pytest.fixture
def s3_bucket(s3_client):
    name = f"tf-{uuid.uuid4().hex[:24]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def store_root(request, tmp_path):
    """A fresh, empty storage root: a local folder, or ``s3://<new bucket>/store`` on moto."""
    if request.param == "local":
        return str(tmp_path / "store")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/store"


def _set_auth(endpoint: str, count: str) -> None:
    req = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=count.encode(), method="POST", headers={"Content-Type": "text/plain"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


@pytest.fixture
def s3_iam_user(s3_endpoint):
    """{"key", "secret"} of an IAM user allowed s3:*, with signature checks on for this test only."""
    iam = _boto_client("iam", s3_endpoint)
    name = f"user-{uuid.uuid4().hex[:12]}"
    iam.create_user(UserName=name)
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName=name, PolicyName="s3-all", PolicyDocument=json.dumps(policy))
    cred = iam.create_access_key(UserName=name)["AccessKey"]
    _set_auth(s3_endpoint, "0")
    try:
        yield {"key": cred["AccessKeyId"], "secret": cred["SecretAccessKey"]}
    finally:
        _set_auth(s3_endpoint, "inf")


class RawStorage:
    """Out-of-band access to a storage root (plain files, or boto3 on S3), bypassing trajflow and s3fs caches."""

    def __init__(self, root: str, s3_client=None):
        self.root = root
        self.s3 = s3_client
        if root.startswith("s3://"):
            self.bucket, _, self.prefix = root[len("s3://"):].partition("/")
        else:
            self.folder = root[len("file://"):] if root.startswith("file://") else root

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def write(self, rel: str, data: bytes) -> None:
        if self.s3 is not None:
            self.s3.put_object(Bucket=self.bucket, Key=self._key(rel), Body=data)
        else:
            import os

            path = os.path.join(self.folder, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)

    def read(self, rel: str) -> bytes:
        if self.s3 is not None:
            return self.s3.get_object(Bucket=self.bucket, Key=self._key(rel))["Body"].read()
        with open(f"{self.folder}/{rel}", "rb") as f:
            return f.read()

    def delete(self, rel: str) -> None:
        if self.s3 is not None:
            self.s3.delete_object(Bucket=self.bucket, Key=self._key(rel))
        else:
            import os

            os.unlink(f"{self.folder}/{rel}")

    def keys(self) -> list[str]:
        """Every stored file, relative to the root, sorted."""
        if self.s3 is not None:
            out, token = [], None
            while True:
                kw = {"Bucket": self.bucket, "Prefix": self.prefix + "/"}
                if token:
                    kw["ContinuationToken"] = token
                page = self.s3.list_objects_v2(**kw)
                out += [o["Key"][len(self.prefix) + 1:] for o in page.get("Contents", [])]
                if not page.get("IsTruncated"):
                    return sorted(out)
                token = page["NextContinuationToken"]
        import os

        return sorted(
            os.path.relpath(os.path.join(d, f), self.folder).replace(os.sep, "/")
            for d, _, files in os.walk(self.folder)
            for f in files
        )


@pytest.fixture
def adapter_src(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "adapter_config.json").write_bytes(b'{"r": 8}')
    (src / "adapter_model.safetensors").write_bytes(os.urandom(200_000))
    return src


@pytest.fixture
def raw_storage(store_root, request) -> RawStorage:
    """Out-of-band reads and writes under ``store_root`` (to tamper, truncate, or look at the layout)."""
    client = request.getfixturevalue("s3_client") if store_root.startswith("s3://") else None
    return RawStorage(store_root, client)


class StorageWrites:
    """Every change that reaches storage under a root, recorded where the bytes land, below the store.

    Local: a file appearing under its final name (``os.replace``/``os.rename``/``os.link`` onto it, or
    ``open`` in a writing mode on it; the temporary files of atomic writes are not final names) and
    ``os.unlink``/``os.remove``. S3: every writing or deleting S3 call s3fs makes (``put_object``,
    ``copy_object``, ``complete_multipart_upload``, ``delete_object(s)``). Each event is
    ``(operation, path relative to the root)``.
    """

    S3_CALLS = ("put_object", "copy_object", "complete_multipart_upload", "delete_object", "delete_objects")

    def __init__(self, root: str):
        self.root = root
        self.events: list[tuple[str, str]] = []
        if root.startswith("s3://"):
            self.bucket, _, self.prefix = root[len("s3://"):].partition("/")
        else:
            self.folder = root[len("file://"):] if root.startswith("file://") else root

    def _local(self, op: str, path) -> None:
        from storage.names import is_temp_name

        path = os.path.abspath(os.fspath(path))
        if path.startswith(self.folder.rstrip("/") + "/") and not is_temp_name(os.path.basename(path)):
            self.events.append((op, path[len(self.folder.rstrip("/")) + 1:]))

    def _s3(self, method: str, kwargs: dict) -> None:
        deleted = kwargs.get("Delete", {}).get("Objects", [])
        keys = [kwargs.get("Key")] if "Key" in kwargs else [o["Key"] for o in deleted]
        for key in keys:
            if kwargs.get("Bucket") == self.bucket and key and key.startswith(self.prefix + "/"):
                self.events.append((method, key[len(self.prefix) + 1:]))

    def install(self, monkeypatch) -> StorageWrites:
        if not self.root.startswith("s3://"):
            import builtins

            recorder = self
            for name in ("replace", "rename", "link"):
                original = getattr(os, name)

                def move(src, dst, *args, _original=original, _name=name, **kwargs):
                    result = _original(src, dst, *args, **kwargs)
                    recorder._local(_name, dst)
                    return result

                monkeypatch.setattr(os, name, move)
            for name in ("unlink", "remove"):
                original = getattr(os, name)

                def remove(path, *args, _original=original, _name=name, **kwargs):
                    result = _original(path, *args, **kwargs)
                    recorder._local(_name, path)
                    return result

                monkeypatch.setattr(os, name, remove)
            real_open = builtins.open

            def opener(file, mode="r", *args, **kwargs):
                handle = real_open(file, mode, *args, **kwargs)
                if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
                    recorder._local("open", file)
                return handle

            monkeypatch.setattr(builtins, "open", opener)
        else:
            import s3fs

            original_call = s3fs.S3FileSystem._call_s3
            recorder = self

            async def call_s3(fs, method, *args, **kwargs):
                result = await original_call(fs, method, *args, **kwargs)
                if method in StorageWrites.S3_CALLS:
                    recorder._s3(method, kwargs)
                return result

            monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)
        return self

    def paths(self) -> list[str]:
        return [path for _, path in self.events]


@pytest.fixture
def storage_writes(store_root, monkeypatch) -> StorageWrites:
    """A :class:`StorageWrites` recording under ``store_root`` for the rest of the test."""
    return StorageWrites(store_root).install(monkeypatch)
