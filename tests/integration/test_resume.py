"""Kill the training flow with SIGKILL at three moments and resume it on a fresh Prefect home.

One chain per storage kind (local folder, S3 on moto): kill (a) after the first rollout group of step
1 is stored, (b) in the middle of step 1's training, (c) after step 2 is trained and published but
before its commit; then run to the end. Each run is a process of its own running `flows.train` as
`__main__` with a new PREFECT_HOME (a new machine); it is forked from tests/forkserver.py, which
imported torch, transformers and peft once (~6 s saved per run). The flow processes report to the
session's Prefect API server, which outlives the killed ones, as a shared server does in production
(each process is spared the ~20 s start of an ephemeral server on a fresh database). The local
chain's last resume instead runs on Prefect's default ephemeral API with a brand-new database:
nothing but the run's storage carries the run over. The inference server is shared and sits behind
a counting proxy, so the test sees every rollout request.
Asserted: no stored rollout group is requested again, the run reaches the final step, and the
adapters are byte-identical to an uninterrupted run's on the same rollouts.

Why "on the same rollouts": batched inference is not bitwise batch-invariant (the same seeded request
alone or beside five others gave the same tokens but logprobs 4.8e-7 apart on this CPU), and rollout
batches depend on arrival timing. So the uninterrupted reference is a fresh run over a copy of the
chain's stored rollout groups (nothing else: no checkpoints, no manifests past step 0, no Prefect
cache records); it must request no rollout and train steps 1 and 2 in one go to the same bytes.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from storage.store import RunStore
from tests.fixtures_resume import train_invocation
from tests.paths import REPO

GROUPS, GROUP_SIZE, STEPS = 3, 3, 2


def run_flow(launcher, root: str, proxy_url: str, tmp_path: Path, crash_at: str | None,
             env_extra: dict | None = None, api_url: str | None = None, steps: int = STEPS, sets: tuple = ()):
    """One `python -m flows.train` run (forked) on a fresh PREFECT_HOME; `api_url` None: Prefect's ephemeral API."""
    argv, env, log_path = train_invocation(root, proxy_url, tmp_path, crash_at, env_extra, api_url,
                                           steps=steps, groups=GROUPS, group_size=GROUP_SIZE, sets=sets)
    code = launcher.run(argv, env, REPO, log_path, timeout=400)
    return code, log_path.read_text()


def adapter_bytes(store: RunStore, step: int) -> bytes:
    return store.get_bytes(step, "adapter/adapter_model.safetensors")


def copy_rollouts_only(store: RunStore, target: Path) -> None:
    """Copy run.json, step 0 and every stored rollout group of the run to a local folder."""
    import fsspec

    fs, base = fsspec.core.url_to_fs(store.url)
    for path in fs.find(base):
        rel = path[len(base.rstrip("/")) + 1:]
        if rel == "run.json" or rel.startswith("steps/00000/") or "/groups/" in rel:
            dest = target / store.project / store.run / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(fs.cat_file(path))


def storage_of(kind: str, tmp_path: Path, request) -> tuple[str, dict]:
    """(storage root, environment for the flow processes) of a local folder or a moto S3 bucket."""
    if kind == "local":
        return str(tmp_path / "runs"), {}
    bucket = request.getfixturevalue("s3_bucket")  # also sets AWS_ENDPOINT_URL and dummy keys
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")}
    return f"s3://{bucket}/runs", env


def session_api() -> str:
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()  # the session's server (prefect_api); it survives every kill
    assert api and api.startswith("http://127.0.0.1:"), api
    return api


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_kill_and_resume(kind, counting_server, prefect_api, fork_launcher, tmp_path, request):
    api = session_api()
    root, env = storage_of(kind, tmp_path, request)
    store = RunStore(root, "ci", "tiny")
    proxy, launcher = counting_server, fork_launcher

    # (a) killed right after the first group of step 1 was stored, the other groups' requests in flight
    proxy.reset()
    proxy.hold_rollouts_after("tiny@0", GROUP_SIZE)
    code, out = run_flow(launcher, root, proxy.url, tmp_path, "rollouts-group:1", env, api)
    assert code == -signal.SIGKILL, out[-3000:]
    stored = len(store.list_files(1, "groups/"))
    assert stored == 1 and store.committed_steps() == [0]

    # (b) resumed: only the missing group is requested; killed in the middle of step 1's training
    proxy.reset()
    code, out = run_flow(launcher, root, proxy.url, tmp_path, "training:1", env, api)
    assert code == -signal.SIGKILL, out[-3000:]
    assert len(proxy.rollout_requests("tiny@0")) == (GROUPS - stored) * GROUP_SIZE
    assert len(store.list_files(1, "groups/")) == GROUPS
    assert store.committed_steps() == [0] and not store.exists(1, "training.json")

    # (c) resumed: step 1 trains from stored rollouts (no request), step 2 runs; killed before its commit
    proxy.reset()
    code, out = run_flow(launcher, root, proxy.url, tmp_path, "before-commit:2", env, api)
    assert code == -signal.SIGKILL, out[-3000:]
    assert proxy.rollout_requests("tiny@0") == []
    assert len(proxy.rollout_requests("tiny@1")) == GROUPS * GROUP_SIZE
    assert store.committed_steps() == [0, 1] and store.exists(2, "training.json")

    # resumed to the end: nothing of step 2 is sampled again, and the result equals the uninterrupted run.
    # The local chain does it on the default ephemeral API (a new database): only storage carries the run.
    proxy.reset()
    code, out = run_flow(launcher, root, proxy.url, tmp_path, None, env, None if kind == "local" else api)
    assert code == 0, out[-3000:]
    assert proxy.rollout_requests("tiny@0") == [] and proxy.rollout_requests("tiny@1") == []
    assert store.committed_steps() == [0, 1, 2]

    # the uninterrupted reference on the same rollouts: no request, same adapter bytes at every step
    replay_root = tmp_path / "replay"
    copy_rollouts_only(store, replay_root)
    proxy.reset()
    code, out = run_flow(launcher, str(replay_root), proxy.url, tmp_path, None, api_url=api)
    assert code == 0, out[-3000:]
    assert proxy.rollout_requests("tiny@0") == [] and proxy.rollout_requests("tiny@1") == []
    replay = RunStore(str(replay_root), "ci", "tiny")
    for step in range(1, STEPS + 1):
        assert adapter_bytes(replay, step) == adapter_bytes(store, step), f"adapter of step {step} differs"


ASYNC = ("pipeline.max_off_policy_steps=1", "retention.keep_last=4")  # the replay below starts from step 0
ASYNC_STEPS = 3  # step s samples with tiny@max(0, s-2): steps 1 and 2 with tiny@0, step 3 with tiny@1


def missing_groups(store: RunStore) -> dict[int, int]:
    """Step -> groups of it not stored yet."""
    return {s: GROUPS - len(store.list_files(s, "groups/")) for s in range(1, ASYNC_STEPS + 1)}


def assert_sampled_once(proxy, missing: dict[int, int], steps_done: tuple[int, ...]) -> None:
    """The rollout requests of one run, for each policy that samples a step in `steps_done` (steps whose rollouts
    all finished in that run): one per trajectory of a group that was missing when the run started, no more."""
    by_policy: dict[int, int] = {}
    for step in steps_done:
        by_policy[max(0, step - 2)] = by_policy.get(max(0, step - 2), 0) + missing[step] * GROUP_SIZE
    for policy, expected in by_policy.items():
        assert len(proxy.rollout_requests(f"tiny@{policy}")) == expected, (policy, expected)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_async_kill_and_resume(kind, counting_server, prefect_api, fork_launcher, tmp_path, request):
    """pipeline.max_off_policy_steps=1, 3 steps: killed (a) mid-rollouts of step 2 while step 1 runs; then, locally,
    (c) after step 2 is trained and published, before its commit (step 3's rollouts running ahead); on S3, with the
    update in a trainer process (training.mode=process), (b) inside that process after step 2's update, before its
    checkpoint is stored (the crash point kills the flow; the trainer process exits with it); then resumed to the
    end, each run on a fresh Prefect home. No stored group is sampled again, every trained group was sampled within
    the bound, and an uninterrupted k=1 run on the same rollouts with the update in the flow's process gives the same
    adapters: the same bytes locally; to rounding after the trainer process, a fresh interpreter (it differed in the
    last bit of a few weights in 5 of 17 runs: MKL's default code path depends on where buffers land, and the flow
    runs here are all forked from one process while the trainer process is not; README, "Async pipeline")."""
    from tests.integration.test_trainer_process import wait_gone

    api = session_api()
    root, env = storage_of(kind, tmp_path, request)
    store = RunStore(root, "ci", "tiny")
    proxy, launcher = counting_server, fork_launcher
    sets = (*ASYNC, "training.mode=process") if kind == "s3" else ASYNC

    def run(crash_at):
        proxy.reset()
        missing = missing_groups(store)
        code, out = run_flow(launcher, root, proxy.url, tmp_path, crash_at, env, api, ASYNC_STEPS, sets)
        for pid in re.findall(r"trainer process started \(pid (\d+)\)", out):
            wait_gone(int(pid))  # a killed flow leaves no trainer behind
        return code, out, missing

    # (a) killed right after the first group of step 2 is stored: step 2's rollouts ran beside step 1's
    code, out, _ = run("rollouts-group:2")
    assert code == -signal.SIGKILL, out[-3000:]
    assert GROUPS - missing_groups(store)[2] >= 1 and store.committed_steps() in ([0], [0, 1])

    if kind == "s3":
        # (b) resumed: steps 1 and 2 sample only their missing groups; killed inside the trainer process
        code, out, missing = run("training:2")
        assert code == -signal.SIGKILL and "trainer process started" in out, out[-3000:]
        assert_sampled_once(proxy, missing, (1, 2))
        assert store.committed_steps() == [0, 1] and not store.exists(2, "training.json")
    else:
        # (c) resumed: steps 1 and 2 sample only their missing groups; killed between step 2's publish and commit
        code, out, missing = run("before-commit:2")
        assert code == -signal.SIGKILL, out[-3000:]
        assert_sampled_once(proxy, missing, (1, 2))
        assert store.committed_steps() == [0, 1] and store.exists(2, "training.json")

    # resumed to the end: what was stored is not sampled again
    code, out, missing = run(None)
    assert code == 0, out[-3000:]
    assert_sampled_once(proxy, missing, (1, 2, 3))
    assert store.committed_steps() == [0, 1, 2, 3] and missing_groups(store) == {1: 0, 2: 0, 3: 0}
    for step in range(1, ASYNC_STEPS + 1):  # every trained group within the bound, as scheduled
        assert {g.policy_step for g in store.read_groups(step, "scored.parquet")} == {max(0, step - 2)}
        assert store.read_manifest(step).metrics["pipeline/staleness_max"] <= 1

    # the uninterrupted k=1 run on the same rollouts, the update in the flow's process: no request, same adapters
    out = assert_async_replay_equal(store, proxy, launcher, tmp_path, api, exact=kind == "local")
    assert "trainer process started" not in out


def assert_async_replay_equal(store: RunStore, proxy, launcher, tmp_path: Path, api: str, exact: bool) -> str:
    """An uninterrupted k=1 run (update in the flow's process) over a copy of `store`'s rollouts requests nothing and
    trains every step to the same adapter (`exact`: bytes; else every weight within float32 rounding); its log."""
    replay_root = tmp_path / "replay"
    copy_rollouts_only(store, replay_root)
    proxy.reset()
    code, out = run_flow(launcher, str(replay_root), proxy.url, tmp_path, None, api_url=api, steps=ASYNC_STEPS,
                         sets=ASYNC)
    assert code == 0, out[-3000:]
    assert all(not proxy.rollout_requests(f"tiny@{p}") for p in range(ASYNC_STEPS))
    replay = RunStore(str(replay_root), "ci", "tiny")
    for step in range(1, ASYNC_STEPS + 1):
        if exact:
            assert adapter_bytes(replay, step) == adapter_bytes(store, step), f"adapter of step {step} differs"
        else:
            assert_adapters_close(adapter_bytes(replay, step), adapter_bytes(store, step), step)
    return out


def assert_adapters_close(expected: bytes, actual: bytes, step: int) -> None:
    """Same tensors, every weight within 1e-5 relative (the runs differed in the last bit of a few of ~10k)."""
    import torch
    from safetensors.torch import load

    want, got = load(expected), load(actual)
    assert sorted(want) == sorted(got), step
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-7, msg=f"step {step}: {name}")

