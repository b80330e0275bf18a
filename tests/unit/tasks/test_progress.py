"""Progress of a task: its Prefect progress artifact, sent off the work's path through clients that share one TLS
context."""

from __future__ import annotations

import asyncio

from tasks.support.prefect_client import api_client, tls_context
from tasks.support.progress import _SENDER, Progress, flush_progress


def test_progress_artifact_follows_the_work_to_100_percent(prefect_api):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    async def work() -> tuple:
        progress = await Progress("rollouts step 1", total=4, every_s=0).start()
        await progress.flush()
        assert progress._artifact_id is not None
        for _ in range(3):
            await progress.advance()
        await progress.flush()
        async with get_client() as client:
            (midway,) = await client.read_artifacts(artifact_filter=ArtifactFilter(
                id=ArtifactFilterId(any_=[progress._artifact_id])))
        await progress.advance()
        return progress._artifact_id, midway.data

    @flow
    def rollouts():
        return asyncio.run(work())

    artifact_id, midway = rollouts()
    flush_progress()

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))

    (done,) = asyncio.run(read())
    assert (done.type, midway, done.data) == ("progress", 75.0, 100.0)


def test_the_work_never_waits_for_the_api(prefect_api):
    """While the API is busy (here: a call ahead in the queue that does not finish), advancing returns at once, and
    the artifact shows the latest progress once the API answers."""
    import threading

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    release = threading.Event()

    async def busy_api() -> None:
        await asyncio.to_thread(release.wait, 30)

    async def work():
        progress = await Progress("rollouts step 2", total=3, every_s=0).start()
        await progress.flush()
        _SENDER.submit(busy_api)
        for _ in range(3):
            await progress.advance()  # would block for 30 s if it waited for its call to be sent
        assert progress._sent == 0.0
        release.set()
        await progress.flush()
        return progress._artifact_id

    @flow
    def rollouts():
        return asyncio.run(asyncio.wait_for(work(), timeout=20))

    artifact_id = rollouts()

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))

    (done,) = asyncio.run(read())
    assert done.data == 100.0


def test_api_clients_share_one_tls_context_built_as_prefect_builds_it():
    import ssl

    from prefect.settings import PREFECT_API_TLS_INSECURE_SKIP_VERIFY, temporary_settings

    a, b = api_client(), api_client()
    assert a is not b  # a client per use: httpx clients must not cross event loops
    assert a._client._transport._pool._ssl_context is b._client._transport._pool._ssl_context is tls_context()
    assert tls_context().verify_mode == ssl.CERT_REQUIRED and tls_context().check_hostname
    with temporary_settings(updates={PREFECT_API_TLS_INSECURE_SKIP_VERIFY: True}):
        assert tls_context().verify_mode == ssl.CERT_NONE  # the setting still decides, as in Prefect's own client
