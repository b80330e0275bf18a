"""`trajflow sft CONFIG [--set ...]`: only the supervised warm start of a config, i.e. its step 0 (tasks/sft.py).

The same code as the flow's SFT stage, without Prefect: the checks of flows/preflight.py (config, storage, the run's
identity and lease, the demonstrations), then SFT, resumed from its last save point if one is stored, and step 0's
checkpoint. It prints the loss per epoch and what to run next; ``trajflow train`` with the same config then
publishes and probes step 0, commits it and continues with GRPO. A step 0 already trained is reported, not redone.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from backends.training.sft_data import DemonstrationError
from flows.arguments import sft_parser
from flows.console import log_file_for, setup_console
from flows.preflight import USAGE_EXIT, CommandError, check_run, check_storage, load_for_command, run_guarded
from storage.lease import RunLease
from tasks.run_config import RunConfig
from tasks.sft import sft_policy_fn
from tasks.support.runtime import close_runtime, get_runtime


def _summary(config: RunConfig, args: argparse.Namespace, training: dict, url: str) -> str:
    metrics = training.get("metrics") or {}
    epochs = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in metrics.items() if k.startswith("sft/loss_epoch_"))
    lines = [f"epoch {k}/{len(epochs)}: loss {v:.4f}" for k, v in epochs]
    skipped = int(metrics.get("sft/skipped", 0))
    lines.append(f"{config.project}/{config.run} step 0 is the SFT'd adapter ({int(metrics.get('sft/conversations', 0))}"
                 f" conversations, {int(metrics.get('sft/trained_tokens', 0))} trained tokens per epoch"
                 + (f", {skipped} bad lines skipped" if skipped else "") + f"): {url}")
    base = ([args.config] if args.config else []) + [x for o in args.overrides for x in ("--set", o)]
    lines.append("next: " + shlex.join(["trajflow", "train", *base]) + "  (publishes step 0, then GRPO)")
    return "\n".join(lines)


def run_command(args: argparse.Namespace) -> int:
    """Run the SFT stage of `args`' config; 0, or a one-line error and its exit code."""

    def run() -> int:
        config = load_for_command(args)
        if config.sft is None:
            raise CommandError("the config has no sft section (sft: {data: FILE, epochs: N, learning_rate: X})",
                               USAGE_EXIT)
        check_storage(config.storage)
        check_run(config)
        setup_console(args.verbose, log_file_for(config.project, config.run),
                      f"trajflow sft: {config.project}/{config.run}")
        store = get_runtime(config).store
        lease = RunLease(store, "trajflow sft").acquire()
        try:
            training = sft_policy_fn(config)
            if store.read_run_config() is None:
                store.write_run_config(config.model_dump(mode="json"))  # step 0 exists: the run is this config's
        except DemonstrationError as exc:
            raise CommandError(str(exc), USAGE_EXIT) from None
        finally:
            lease.release()
            close_runtime(config)
        print(_summary(config, args, training, store.step_url(0)))
        return 0

    return run_guarded("trajflow sft", run)


if __name__ == "__main__":
    sys.exit(run_command(sft_parser().parse_args()))
