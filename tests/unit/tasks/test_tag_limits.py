"""The train task keeps its tag only while a concurrency limit on it exists, against a real Prefect API."""

from prefect import task

from tasks.support.tag_limits import tags_with_limits, with_tag_limits


@task(tags=["tag-limits-test", "tag-limits-other"])
def tagged() -> int:
    return 1


def test_a_tag_is_kept_only_while_its_limit_exists(prefect_api):
    from prefect.client.orchestration import get_client

    assert tags_with_limits(["tag-limits-test"]) == set()
    assert with_tag_limits(tagged).tags == set()
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag="tag-limits-test", concurrency_limit=1)  # `prefect concurrency-limit create`
        try:
            assert tags_with_limits(tagged.tags) == {"tag-limits-test"}
            assert with_tag_limits(tagged).tags == {"tag-limits-test"}
        finally:
            client.delete_concurrency_limit_by_tag("tag-limits-test")
    assert tags_with_limits(tagged.tags) == set()


def test_a_task_without_tags_is_not_looked_up():
    @task
    def plain() -> int:
        return 1

    assert with_tag_limits(plain) is plain  # no API call: no `prefect_api` fixture here
