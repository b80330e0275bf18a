"""One trainer per run behind `trajflow backend serve`, through RemoteBackend and the real HTTP server.

While a train request runs, registering the same model again returns the run as it is (no second trainer) and a
second writing request gets a 409 naming what runs; the committed step's bytes match its manifest and stay so.
Another backend (another process, or another LocalBackend here) on the same run is refused by the run's lease.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from agents import TrainableModel, Trajectory, TrajectoryGroup, gather_trajectory_groups
from backends import RemoteBackend
from backends.art.local_backend import LocalBackend
from backends.art.remote_backend import RemoteBackendError
from storage.errors import StorageError
from storage.fs import sha256_bytes
from storage.layout import SCORED
from storage.lease import RunLease, RunLeaseHeldError
from storage.store import RunStore
from tests.fixtures_backend import BACKEND_KEY


async def rollout(model, scenario: str) -> Trajectory:
    messages = [{"role": "user", "content": scenario}]
    traj = Trajectory(messages_and_choices=[*messages], reward=0.0)
    resp = await model.openai_client().chat.completions.create(model=model.name, messages=messages, max_tokens=4)
    traj.messages_and_choices.append(resp.choices[0])
    traj.reward = float(len(resp.choices[0].message.content or "") % 3)
    return traj


async def groups_for(model) -> list[TrajectoryGroup]:
    return await gather_trajectory_groups(
        (TrajectoryGroup(rollout(model, s) for _ in range(3)) for s in ("2+2?", "a colour?")), pbar_desc=None)


def test_register_during_train_returns_the_run_and_a_second_writer_gets_409(backend_server, monkeypatch):
    import backends.training.trainer as trainer_module
    from backends.art import local_backend

    built, entered, gate = [], threading.Event(), threading.Event()
    real_trainer, real_train_step = trainer_module.GRPOTrainer, local_backend.train_step

    def counting_trainer(*args, **kwargs):
        built.append(args)
        return real_trainer(*args, **kwargs)

    def held_train_step(*args, **kwargs):  # the update of step 1 waits until the test has sent its requests
        entered.set()
        gate.wait(timeout=20)
        return real_train_step(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "GRPOTrainer", counting_trainer)
    monkeypatch.setattr(local_backend, "train_step", held_train_step)

    async def main():
        first, second = RemoteBackend(backend_server.url, BACKEND_KEY), RemoteBackend(backend_server.url, BACKEND_KEY)
        model = TrainableModel(name="one", project="p", base_model="tiny-random")
        other = TrainableModel(name="one", project="p", base_model="tiny-random")  # a second script, same run
        try:
            await model.register(first)
            groups = await groups_for(model)
            training = asyncio.create_task(model.train(groups))
            assert await asyncio.to_thread(entered.wait, 60)
            await other.register(second)  # the run as it is: no second trainer
            assert await other.get_step() == 0
            refused = []
            for call in (other.train(groups), other.log(groups, split="val"), other.delete_checkpoints()):
                with pytest.raises(RemoteBackendError) as err:
                    await call
                refused.append(err.value)
            assert [e.status for e in refused] == [409, 409, 409]
            assert all("run p/one is busy training step 1" in str(e) for e in refused), refused
            gate.set()
            assert (await training).step == 1
            assert (await other.train(await groups_for(other))).step == 2  # free again: the next step
        finally:
            gate.set()
            await first.close()
            await second.close()

    asyncio.run(main())
    assert len(built) == 1  # one trainer for the run, whoever registered it
    store = RunStore(backend_server.storage, "p", "one")
    assert store.committed_steps() == [0, 1, 2]
    for step in (1, 2):
        for rel, entry in store.read_manifest(step).files.items():
            assert sha256_bytes(store.get_bytes(step, rel)) == entry.sha256, (step, rel)
    # a committed step's files are never written again, by anyone
    stale = RunStore(backend_server.storage, "p", "one")
    with pytest.raises(StorageError, match="step 1 is committed"):
        stale.put_bytes(1, SCORED, b"other bytes")


def test_another_backend_on_the_same_run_is_refused_by_its_lease(backend_server, tmp_path):
    async def main():
        remote = RemoteBackend(backend_server.url, BACKEND_KEY)
        model = TrainableModel(name="held", project="p", base_model="tiny-random")
        await model.register(remote)
        other = LocalBackend(storage=backend_server.storage, device="cpu")  # as another process would
        try:
            with pytest.raises(RunLeaseHeldError, match=r"run p/held .* is in use by LocalBackend \(pid \d+") as err:
                await TrainableModel(name="held", project="p", base_model="tiny-random").register(other)
            assert "expires" in str(err.value)
            await remote.close()
        finally:
            other.close()
        backend_server.backend.close()  # the server's backend lets the run go
        other = LocalBackend(storage=backend_server.storage, device="cpu")
        try:
            again = TrainableModel(name="held", project="p", base_model="tiny-random")
            await again.register(other)
            assert await again.get_step() == 0
        finally:
            other.close()

    asyncio.run(main())


def test_a_lease_held_elsewhere_is_a_409_over_http(backend_server):
    holder = RunLease(RunStore(backend_server.storage, "p", "elsewhere"), "trajflow train", ttl_s=60).acquire()
    try:
        resp = backend_server.post("/backend/register", {"project": "p", "name": "elsewhere",
                                                          "base_model": "tiny-random"})
        assert resp.status_code == 409 and "is in use by trajflow train" in resp.json()["detail"]
    finally:
        holder.release()
    assert not (RunStore(backend_server.storage, "p", "elsewhere").read_run_config())
