"""S3 fixtures: moto's S3 server on 127.0.0.1 (ephemeral port), started once per session.

- ``moto_endpoint`` (session): the server's URL; sets no environment.
- ``s3_endpoint``: the same URL, with AWS_ENDPOINT_URL, dummy keys and AWS_DEFAULT_REGION set for
  the test (production code needs no endpoint plumbing).
- ``s3_bucket``: a fresh bucket per test (the server is never reset, so other session fixtures' buckets survive).
- ``store_root``: parametrized ["local", "s3"]: a fresh storage root per test.
- ``s3_iam_user``: a moto IAM user with full S3 rights, and moto's signature checking switched on
  for the test (switched off again afterwards).
"""

from __future__ import annotations

import json
import logging
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
def raw_storage(store_root, request) -> RawStorage:
    """Out-of-band reads and writes under ``store_root`` (to tamper, truncate, or look at the layout)."""
    client = request.getfixturevalue("s3_client") if store_root.startswith("s3://") else None
    return RawStorage(store_root, client)
