"""A task keeps a tag only where a concurrency limit on it exists: ``tag:<tag>`` (what ``prefect concurrency-limit
create <tag> N`` makes).

Prefect 3.9 acquires a slot of ``tag:<tag>`` through the API before every tagged task run starts, whether or not the
limit exists (it remembers "no limit" for 5 s only). The API answers that with a deferred transaction that reads the
limits and then writes; on the ephemeral API's SQLite, when another writer commits in between (its task-run recorder,
storing the state events of this very task run), SQLite refuses the write at once (SQLITE_BUSY_SNAPSHOT), the API
answers 503 and Prefect's client retries after 2 s plus jitter. A synchronous step of 32 x 16 rollouts lost ~2.3 s
there in most steps (benchmarks/results/orchestration-32x16.md). Reading a limit never conflicts, so
:func:`with_tag_limits` reads each tag's limit at the call and drops the tags that have none: a limit set on a tag
still bounds the task (from the next call on, if created mid-run); a tag without one costs a read. The price: a
task run without a limit does not show the tag in the UI.
"""

from __future__ import annotations

from typing import TypeVar

from tasks.support.prefect_client import api_client

T = TypeVar("T")


def tags_with_limits(tags) -> set[str]:
    """The tags among `tags` that have a concurrency limit (``tag:<tag>``) in the current Prefect API."""
    if not tags:
        return set()
    from prefect.exceptions import ObjectNotFound

    kept = set()
    with api_client(sync=True) as client:
        for tag in tags:
            try:
                client.read_global_concurrency_limit_by_name(f"tag:{tag}")
            except ObjectNotFound:
                continue
            kept.add(tag)
    return kept


def with_tag_limits(task: T) -> T:
    """`task` (a Prefect task) with only those of its tags that have a concurrency limit now."""
    kept = tags_with_limits(task.tags)
    return task if kept == set(task.tags) else task.with_options(tags=kept)
