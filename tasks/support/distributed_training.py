"""A step's GRPO update on N processes under torchrun (``training.gpus: N`` > 1), launched from the train task.

The parent (:func:`train_distributed`, in the flow's process or the ``train-step`` deployment's) runs

    python -m torch.distributed.run --standalone --nproc_per_node N -m tasks.support.distributed_training \\
        CONFIG.json STEP RECORDS_DIR

and waits. Each rank (:func:`main`) builds a trainer on its device (``cuda:<LOCAL_RANK>`` over NCCL with the
GPUs :func:`rank_devices` made visible, or the CPU over gloo), loads checkpoint STEP-1 from storage and takes its
share of the update (``backends/training/distributed.py``); rank 0 alone then writes ``adapter/``, ``trainer/``
and ``training.json`` (last), exactly as a one-process update does. Step 0 (the seeded initial adapter) is written
by one such process (no torchrun needed), so the flow's process never holds a trainer on the training GPUs.

A failed rank fails the step: torchrun stops the others and exits non-zero, nothing is committed (``training.json``
is written last, by rank 0, after every rank's part), and the task's retry or the resumed flow redoes the update from
storage. Which failure it was comes from the records the ranks leave in RECORDS_DIR: a rank that raised writes its
exception there (a rank whose collective failed because another one stopped writes that, as ``PeerLostError``); if
no rank recorded an error of its own, one was killed by a signal (out of memory, preemption, a kill), which is
transient (:class:`RankLostError`, retried).

The ranks do not outlive the process that launched them: each one watches its pid (``TRAJFLOW_TRAINING_PARENT``)
and exits at once when it is gone. A flow killed with SIGKILL mid-update would otherwise leave torchrun and its
ranks running, still writing the step, while the resumed flow starts the same update again; exiting before
``training.json`` leaves nothing the resumed update takes for done (files are written under temporary names and
renamed, so a write cut short is never seen).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from storage.lease import process_gone
from tasks.run_config import RunConfig
from tasks.support.placement import cuda_visible, devices
from tasks.support.retry_policy import TransientError, is_transient

log = logging.getLogger("trajflow")

ERROR_RECORD = "rank-{rank}.error.json"
OUTPUT_TAIL_LINES = 30
PARENT_ENV = "TRAJFLOW_TRAINING_PARENT"
PARENT_POLL_S = 0.5
ORPHANED_EXIT = 75  # EX_TEMPFAIL: the launcher is gone, nothing of the step was finished by this rank


class RankLostError(TransientError):
    """A rank of the update died without an error of its own (a signal: out of memory, preemption, a kill)."""


def rank_devices(device: str, gpus: int, visible: str | None) -> tuple[str, str | None]:
    """(the device the ranks train on, CUDA_VISIBLE_DEVICES for the job) for `gpus` processes from `device`
    (resolved: 'cpu', 'cuda' or 'cuda:K'): the CPU, or the GPUs K..K+N-1 of this process
    (``tasks/support/placement.py``), which rank r then finds at cuda:r."""
    if device == "cpu":
        return "cpu", None
    placed = devices(device, gpus, gpus_visible=1)
    try:
        return "cuda", cuda_visible(placed, visible)
    except ValueError as exc:
        raise ValueError(f"training.gpus={gpus} from {device} needs GPUs {placed[0]}..{placed[-1]}: {exc}") from None


def torchrun_argv(processes: int, config_file: Path, step: int, records: Path) -> list[str]:
    """The command that runs the update of `step` on `processes` ranks of this machine (one: no torchrun)."""
    rank_argv = ["-m", __name__, str(config_file), str(step), str(records)]
    if processes == 1:
        return [sys.executable, *rank_argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *rank_argv]


def train_distributed(config: RunConfig, step: int) -> None:
    """Run the update of `step` (0: write the initial adapter) under torchrun; returns once rank 0 stored it.

    Raises RankLostError (transient) when a rank was killed, else the first rank's own error, one line each.
    The ranks' output goes to a temporary file, whose tail is logged when the step fails.
    """
    from backends.modeling.devices import resolve_device

    processes = 1 if step == 0 else config.training.gpus
    device, visible = rank_devices(resolve_device(config.training.device), processes,
                                   os.environ.get("CUDA_VISIBLE_DEVICES"))
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    with tempfile.TemporaryDirectory(prefix="trajflow-torchrun-") as tmp:
        tmp_path = Path(tmp)
        config_file, records, output = tmp_path / "config.json", tmp_path / "records", tmp_path / "output.log"
        records.mkdir()
        config_file.write_text(config.model_dump_json())
        started = time.perf_counter()
        with output.open("wb") as out:
            code = subprocess.run(torchrun_argv(processes, config_file, step, records), env=env, stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
        if code == 0:
            log.info("step %d: update on %d process(es) (%s, torchrun) took %.1f s", step, processes, device,
                     time.perf_counter() - started)
            return
        tail = output.read_text(errors="replace").splitlines()[-OUTPUT_TAIL_LINES:]
        log.error("torchrun exited with %d for step %d; its last lines:\n%s", code, step, "\n".join(tail))
        raise _failure(step, processes, records, tail)


def _failure(step: int, processes: int, records: Path, tail: list[str]) -> Exception:
    """The step's failure from the ranks' records: the first rank's own error, else a lost rank (transient)."""
    errors = sorted((json.loads(p.read_text()) for p in records.glob(ERROR_RECORD.format(rank="*"))),
                    key=lambda r: r["rank"])
    own = [e for e in errors if e["type"] != "PeerLostError"]
    if own:
        first = own[0]
        text = f"training step {step} failed on rank {first['rank']} of {processes}: {first['type']}: {first['message']}"
        return TransientError(text) if first["transient"] else RuntimeError(text)
    exits = "; ".join(" ".join(line.split()) for line in tail if "exitcode" in line) or "no exit status reported"
    return RankLostError(f"training step {step}: a training process of {processes} died without an error of its "
                         f"own (a signal: out of memory, preemption, a kill; torchrun: {exits}); nothing of the step "
                         "was committed, a retry redoes it from storage")


# ---- the rank side -------------------------------------------------------------------------------------------------
def exit_when_gone(pid: int, exit=os._exit, poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """A daemon thread that calls ``exit(ORPHANED_EXIT)`` once process `pid` no longer exists."""

    def watch() -> None:
        while not process_gone(pid):
            time.sleep(poll_s)
        logging.getLogger("trajflow").error("the process that launched this training rank (pid %d) is gone: "
                                            "exiting without finishing the step", pid)
        exit(ORPHANED_EXIT)

    thread = threading.Thread(target=watch, name="trajflow-parent-watch", daemon=True)
    thread.start()
    return thread


def _run_rank(config: RunConfig, step: int, rank: int) -> None:
    from backends.modeling.devices import resolve_device
    from backends.policy.checkpoints import initialize, load_checkpoint, train_step
    from backends.training import distributed
    from backends.training.trainer import GRPOTrainer
    from storage.compile_cache import StoreCompileCache
    from storage.store import RunStore
    from tasks.support.crash_points import crash_point

    store = RunStore(config.storage, config.project, config.run)
    cache = StoreCompileCache(store)  # every rank loads the run's compiled kernels; rank 0 alone stores them
    device = resolve_device(config.training.device)
    if step == 0:  # one process, the first training GPU
        initialize(store, lambda: GRPOTrainer(config.base_model, config.trainer, device=device.partition(":")[0],
                                              compile_cache=cache))
        return
    device = distributed.init_from_torchrun(device)
    try:
        trainer = GRPOTrainer(config.base_model, config.trainer, device=device, compile_cache=cache)
        load_checkpoint(store, step - 1, trainer)
        crash_point(f"training-rank{rank}", step)  # resume tests: a rank killed while the others wait for it
        train_step(store, step, trainer, after_update=lambda s: crash_point("training", s), write=rank == 0,
                   max_off_policy_steps=config.pipeline.max_off_policy_steps)
    finally:
        distributed.close()


def main(argv: list[str] | None = None) -> int:
    """One rank of the update (torchrun starts N of these): CONFIG.json STEP RECORDS_DIR."""
    parser = argparse.ArgumentParser(prog="python -m tasks.support.distributed_training")
    parser.add_argument("config_file", type=Path)
    parser.add_argument("step", type=int)
    parser.add_argument("records", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank " + os.environ.get("RANK", "?") + " %(message)s")
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get(PARENT_ENV):
        exit_when_gone(int(os.environ[PARENT_ENV]))
    try:
        _run_rank(RunConfig.model_validate_json(args.config_file.read_text()), args.step, rank)
    except Exception as exc:
        record: dict[str, Any] = {"rank": rank, "type": type(exc).__name__, "message": str(exc),
                                  "transient": is_transient(exc)}
        (args.records / ERROR_RECORD.format(rank=rank)).write_text(json.dumps(record))
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
