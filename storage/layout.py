"""The run layout, in one place: every file and folder name inside a run and a step is spelled here.

```
<root>/<project>/<run>/run.json                          the run's config, written once its step 0 exists
<root>/<project>/<run>/lease.json                        which process writes the run, until when (storage/lease.py)
<root>/<project>/<run>/steps/<NNNNN>/manifest.json       written last; without it the step does not exist
                                     manifest.json.corrupt-<UTC stamp>   a manifest a reader found corrupt,
                                                         moved aside (the step is not committed; it is redone)
<root>/<project>/<run>/steps/<NNNNN>/scenarios.json      the step's sampled scenarios
                                     groups/<NNNN>.parquet   one rollout group each, stored as it finishes
                                     scored.parquet      the scored groups the update trained on
                                     adapter/            the LoRA adapter (peft: adapter_config.json,
                                                         adapter_model.safetensors)
                                     trainer/            optimizer, scheduler and RNG state, metrics
                                     training.json       the update's metrics, adapter hashes, probe record;
                                                         written after adapter/ and trainer/: the update is done
                                     eval/<NNNN>.parquet, eval.parquet   validation rollouts and their scores
                                     logs/<split>.parquet  trajectories an ART-style script logged
                                     sft-progress/progress.json   a step made by SFT (a run's step 0 with `sft`):
                                                         where the supervised warm start is (written last at
                                                         each save point)
                                     sft-progress/<NNNNNN>/{adapter,trainer}/   its save point after NNNNNN
                                                         optimizer steps (removed once training.json exists)
<root>/<project>/<run>/judge-cache/<hash>.json           judge verdicts by content hash
<root>/<project>/<run>/compile-cache/<hash>.bin          the trainer's torch.compile artifacts, by what makes them
                                                         valid (backends/training/compile_cache.py)
<root>/<project>/<run>/recoveries/<flow run id>.json      a crashed flow run of a deployment and what `recover` did
<root>/<project>/<run>/evaluations/<stamp>/...           `trajflow eval` rollouts; <stamp>.json, <stamp>.png
<root>/<project>/<run>/prefect-results/                  Prefect's cache records for the run's tasks
<root>/<project>/<run>/reward_curve.png                  train and validation reward per committed step
```
A trainer checkpoint folder on local disk has the same ``adapter/`` and ``trainer/`` as a step.
Step numbers have five digits (00000-99999).
"""

from __future__ import annotations

from storage.names import InvalidNameError, safe_relpath, validate_name

RUN_CONFIG = "run.json"
RUN_LEASE = "lease.json"
STEPS_DIR = "steps"
MANIFEST = "manifest.json"
CORRUPT_MANIFEST_PREFIX = f"{MANIFEST}.corrupt-"
MAX_STEP = 99_999

# inside a step
SCENARIOS = "scenarios.json"
GROUPS_DIR = "groups"
SCORED = "scored.parquet"
ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"  # peft's format: what vLLM and the embedded engine load
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_WEIGHTS_REL = f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}"
TRAINER_STATE_DIR = "trainer"
TRAINER_STATE = "state.pt"
TRAINER_META = "trainer.json"
TRAINER_METRICS = "metrics.json"
TRAINING_RESULT = "training.json"
EVAL_GROUPS_DIR = "eval"
EVAL_SCORED = "eval.parquet"
LOGS_DIR = "logs"
SFT_DIR = "sft-progress"
SFT_PROGRESS = f"{SFT_DIR}/progress.json"

# inside a run
JUDGE_CACHE_DIR = "judge-cache"
COMPILE_CACHE_DIR = "compile-cache"
RECOVERIES_DIR = "recoveries"
EVALUATIONS_DIR = "evaluations"
PREFECT_RESULTS_DIR = "prefect-results"
REWARD_CURVE = "reward_curve.png"


def group_file(prefix: str, index: int) -> str:
    """``groups/0003.parquet``: rollout group ``index`` under ``prefix`` (a step's groups, eval, an evaluation)."""
    return f"{prefix}/{index:04d}.parquet"


def scored_file(prefix: str) -> str:
    """The scores of the groups under ``prefix`` (an evaluation's folder)."""
    return f"{prefix}/{SCORED}"


def logged_split(split: str) -> str:
    """``logs/val.parquet``: trajectories an ART-style script logged for ``split`` (named like a run: no ``""``,
    ``"."`` or ``/``)."""
    return f"{LOGS_DIR}/{validate_name('split', split)}.parquet"


def sft_save_point(optimizer_steps: int) -> str:
    """``sft-progress/000040``: the supervised warm start's save point after ``optimizer_steps`` steps (under its step)."""
    return f"{SFT_DIR}/{optimizer_steps:06d}"


def judge_cache_file(key: str) -> str:
    return f"{JUDGE_CACHE_DIR}/{key}.json"


def compile_cache_file(key: str) -> str:
    """``compile-cache/<key>.bin``: the trainer's compile artifacts under ``key``, a sha256 hex digest (anything else,
    a path or ``..``, is an InvalidNameError: the name never leaves the folder)."""
    if not isinstance(key, str) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise InvalidNameError(f"compile cache key must be a 64-char lowercase sha256 hex digest, got {str(key)[:80]!r}")
    return f"{COMPILE_CACHE_DIR}/{key}.bin"


def recovery_file(flow_run_id: str) -> str:
    """``recoveries/<flow run id>.json``: the recovery record of one crashed flow run (one per run: created once)."""
    return f"{RECOVERIES_DIR}/{validate_name('flow run id', flow_run_id)}.json"


def evaluation_dir(stamp: str, label: str) -> str:
    """Where `trajflow eval` stores one policy's rollouts: ``evaluations/<stamp>/<label, @ and / replaced>``."""
    return f"{EVALUATIONS_DIR}/{stamp}/{label.replace('@', '-').replace('/', '_')}"


def evaluation_file(stamp: str, suffix: str) -> str:
    """``evaluations/<stamp>.<suffix>``: the evaluation's table (json) or chart (png)."""
    return f"{EVALUATIONS_DIR}/{stamp}.{suffix}"


def check_step(step: int) -> int:
    """A step number: an int in [0, 99999]."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
    return step


def step_dir(step: int) -> str:
    """``steps/00007``, relative to the run."""
    return f"{STEPS_DIR}/{check_step(step):05d}"


def parse_step_dir(name: str) -> int | None:
    """The step number of a folder name under ``steps/`` (``"00007"`` -> 7), None for anything else."""
    return int(name) if len(name) == 5 and name.isdigit() else None


def is_store_managed(relpath: str) -> bool:
    """True for the step files only the store writes: ``manifest.json`` and its quarantined copies."""
    return relpath == MANIFEST or relpath.startswith(CORRUPT_MANIFEST_PREFIX)


def file_rel(step: int | None, relpath: str) -> str:
    """Path relative to the run of a user file; refuses the names the store itself manages."""
    safe_relpath(relpath)
    if step is None:
        if relpath in (RUN_CONFIG, RUN_LEASE, STEPS_DIR) or relpath.startswith(STEPS_DIR + "/"):
            raise InvalidNameError(
                f"invalid run-level path {relpath!r}: {RUN_CONFIG!r}, {RUN_LEASE!r} and {STEPS_DIR + '/'!r} are "
                "managed by the store"
            )
        return relpath
    if is_store_managed(relpath):
        raise InvalidNameError(
            f"invalid step path {relpath!r}: {MANIFEST!r} (and {CORRUPT_MANIFEST_PREFIX + '*'!r}) is written only by "
            f"the store"
        )
    return f"{step_dir(step)}/{relpath}"


def manifest_rel(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST}"


def quarantined_manifest_rel(step: int, stamp: str) -> str:
    """Where a corrupt manifest is moved: ``steps/00007/manifest.json.corrupt-20260101T120000123456Z``."""
    return f"{step_dir(step)}/{CORRUPT_MANIFEST_PREFIX}{stamp}"
