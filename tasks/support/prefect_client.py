"""A Prefect API client that does not build a new TLS context each time.

Each ``prefect.get_client()`` outside a client context of the same event loop builds an ``ssl.SSLContext``, loading a
CA bundle (Prefect 3.9: ``PrefectClient.__init__``): tens of ms on this 2-core CPU, more under load, even for the
ephemeral API on plain HTTP; a step's progress artifacts take a client per call, each from a fresh event loop.
``api_client()`` passes a context built once per process from the same settings and in the same way as Prefect's
(``PREFECT_API_TLS_INSECURE_SKIP_VERIFY``: unverified; else ``PREFECT_API_SSL_CERT_FILE`` or certifi's bundle), so
what is verified does not change.
"""

from __future__ import annotations

import functools
import ssl


@functools.cache
def _tls_context(insecure: bool, cert_file: str | None) -> ssl.SSLContext:
    if insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    import certifi

    return ssl.create_default_context(cafile=cert_file or certifi.where())


def tls_context() -> ssl.SSLContext:
    """The context Prefect would build for its API client under the current settings, built once."""
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

    return _tls_context(bool(PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value()), PREFECT_API_SSL_CERT_FILE.value() or None)


def api_client(sync: bool = False):
    """An (unstarted) PrefectClient: async for ``async with``, or with `sync` a SyncPrefectClient for ``with``."""
    from prefect.client.orchestration import get_client

    return get_client(sync_client=sync, httpx_settings={"verify": tls_context()})
