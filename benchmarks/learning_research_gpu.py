"""Learning curve of an agent that must learn its format first: base model -> SFT on expert demonstrations -> GRPO.

Per seed (one job; a parallel subprocess with ``--parallel``), in one process with the parts of
``benchmarks/learning_loop.py`` (in-process engine and ``GRPOTrainer``, no Prefect, no HTTP):

1. evaluate the base model on the val set;
2. ``backends.training.sft.run_sft`` on ``--demos`` (default ``configs/demos/<agent>-train.jsonl``, written by
   ``trajflow demos``; the first ``--sft-count`` lines), ``--sft-epochs`` at ``--sft-lr``; the adapter is hot-loaded as
   ``policy@0`` and evaluated;
3. ``--steps`` GRPO steps from the SFT'd adapter (the trainer's own fresh optimizer at ``--lr``), evaluating every
   ``--eval-every`` steps and after the last.

The val set is the agent's val split, or its first ``--val-size`` scenarios in seed-0 order: a fixed subset, the same
for every seed and stage, evaluated with the same rollout seeds at every stage (``--eval-samples`` sampled rollouts
per scenario, plus one greedy). ``--agent research`` (default) reports tool-call validity (well-formed calls / calls
attempted, ``agents.group_metrics.RATIOS``) and tool calls per episode; ``--agent tictactoe`` the illegal-move rate
and the won/drawn/lost shares against the scripted opponent.

Writes ``<out>.json`` (a top-level ``"summary"`` with ``val_reward_base``, ``val_reward_sft``, ``val_reward_rl``:
means over seeds; ``rl_over_sft_min_seed_delta``: the smallest per-seed ``rl - sft``; ``tool_call_validity``: the mean
over seeds of the final evaluation's, null without tools; ``seeds``), per-seed stages and curves beside it, ``<out>.md``
and ``<out>.png`` (val reward per step for each seed, base and SFT marked).

    python benchmarks/learning_research_gpu.py --device cuda --gguf /tmp/smol/x.gguf --parallel --seeds 0 1 2 \\
        --steps 20 --group-size 8 --groups-per-step 16 --eval-every 5 --eval-samples 4 --val-size 64 \\
        --sft-epochs 2 --sft-lr 2e-4 --lr 1e-4 --time-budget-s 360 --out benchmarks/results/learning_research_h200

The CPU smoke run is ``tests/unit/benchmarks/test_learning_research_smoke.py`` (tiny-random, one GRPO step; its
1,024-token context needs the demonstrations shortened).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import learning_loop as loop  # the repository root goes on sys.path first

SUMMARY_KEYS = ("val_reward_base", "val_reward_sft", "val_reward_rl", "rl_over_sft_min_seed_delta",
                "tool_call_validity", "seeds")
STAGES = ("base", "sft", "rl")


@dataclass(frozen=True)
class AgentSpec:
    keys: tuple[str, ...]  # metrics of every evaluation and step, beside the reward
    curve: str  # the second panel of the plot
    max_seq_len: int  # prompt + completion of the longest conversation, with room


AGENTS = {
    "research": AgentSpec(keys=("correct", "tool_call_validity", "tool_calls", "valid_tool_calls", "no_tool_call",
                                "answered", "found_doc", "turns"), curve="tool_call_validity", max_seq_len=2048),
    "tictactoe": AgentSpec(keys=("illegal_move_rate", "illegal", "won", "drawn", "lost", "turns"),
                           curve="illegal_move_rate", max_seq_len=1024),
}


def agent_options(pairs: list[str]) -> dict:
    import yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--agent-option expects key=value, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def val_set(agent, size: int) -> list:
    val = agent.scenarios("val", seed=0)
    return val[:size] if size else val


# --- one job: a seed ---------------------------------------------------------------------------------------------
async def _run_job(model_dir: str, args, seed: int, lr: float) -> dict:
    from agents.registry import get_agent
    from backends.training.sft import run_sft

    spec, options = AGENTS[args.agent], agent_options(args.agent_option)
    started = time.monotonic()
    run = f"{args.agent}-s{seed}"
    agent, greedy_agent = get_agent(args.agent, **options), get_agent(args.agent, **{**options, "temperature": 0.0})
    pool, val = agent.scenarios("train", seed=seed), val_set(agent, args.val_size)
    demos = [json.loads(x) for x in Path(args.demos).read_text().splitlines() if x.strip()][:args.sft_count or None]
    pol = loop.InProcessPolicy(model_dir, args, seed=seed, lr=lr, name=f"learn-{run}",
                          batch_size=max(args.group_size * args.groups_per_step, len(val) * args.eval_samples))
    evals, steps, stopped_early = [], [], False

    async def eval_now(stage: str, step: int) -> dict:
        t0 = time.perf_counter()
        scores = await loop.evaluate(agent, greedy_agent, pol.client, pol.policy, val, args.eval_samples, spec.keys)
        result = {"stage": stage, "step": step, **scores, "eval_s": round(time.perf_counter() - t0, 1)}
        print(f"[{run}] eval {stage} @{step}: reward {result['reward']:.3f} "
              + " ".join(f"{k} {result[k]:.3f}" for k in spec.keys[:3]), flush=True)
        return result

    try:
        base = await eval_now("base", -1)
        t0 = time.perf_counter()
        sft = run_sft(pol.trainer, demos, epochs=args.sft_epochs, learning_rate=args.sft_lr,
                      batch_size=args.sft_batch_size, seed=seed)
        sft_s = round(time.perf_counter() - t0, 1)
        pol.publish(0)
        evals.append(await eval_now("sft", 0))
        for k in range(1, args.steps + 1):
            if args.time_budget_s and time.monotonic() - started > args.time_budget_s:
                stopped_early = True
                print(f"[{run}] time budget reached before step {k}: stopping", flush=True)
                break
            scenarios = loop.pick_train_scenarios(pool, seed, k, args.groups_per_step)
            steps.append(await loop.grpo_step(agent, pol, scenarios, k, args, run, spec.keys))
            print(f"[{run}] step {k}: train reward {steps[-1]['train_reward']:.3f} rollouts "
                  f"{steps[-1]['rollout_s']:.1f}s train+publish {steps[-1]['train_publish_s']:.1f}s", flush=True)
            if k % args.eval_every == 0:
                evals.append(await eval_now("rl", k))
        last = steps[-1]["step"] if steps else 0
        if evals[-1]["step"] != last:
            evals.append(await eval_now("rl", last))
        if evals[-1]["stage"] == "sft":  # no GRPO step ran: the RL stage is the SFT'd policy
            evals.append({**evals[-1], "stage": "rl"})
    finally:
        pol.shutdown()
    return {"seed": seed, "lr": lr, "steps_done": len(steps), "stopped_early": stopped_early,
            "wall_s": round(time.monotonic() - started, 1), "sft_s": sft_s,
            "sft": {k: v for k, v in sft.items() if k != "skipped"}, "demos": len(demos),
            "stages": {"base": base, "sft": evals[0], "rl": evals[-1]}, "evals": evals, "train": steps}


# --- summary, report and plot ------------------------------------------------------------------------------------
def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _clean(obj):
    """NaN (a ratio with nothing to divide, e.g. validity when no call was made) as null: JSON has no NaN."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return _finite(obj) if isinstance(obj, float) else obj


def _mean(xs):
    xs = [x for x in xs if _finite(x) is not None]
    return sum(xs) / len(xs) if xs else None


def summarise(jobs: list[dict], keys: tuple[str, ...]) -> dict:
    """The top-level summary (exactly SUMMARY_KEYS), per-seed stages, and the stage means of every metric."""
    stage = {s: [j["stages"][s] for j in jobs] for s in STAGES}
    deltas = [j["stages"]["rl"]["reward"] - j["stages"]["sft"]["reward"] for j in jobs]
    summary = {
        "val_reward_base": _mean(e["reward"] for e in stage["base"]),
        "val_reward_sft": _mean(e["reward"] for e in stage["sft"]),
        "val_reward_rl": _mean(e["reward"] for e in stage["rl"]),
        "rl_over_sft_min_seed_delta": min(deltas),
        "tool_call_validity": _mean(e.get("tool_call_validity") for e in stage["rl"]),
        "seeds": [j["seed"] for j in jobs],
    }
    per_seed = [{"seed": j["seed"], "rl_over_sft": d, "steps_done": j["steps_done"],
                 **{s: {k: j["stages"][s].get(k) for k in ("reward", *keys, "greedy_reward")} for s in STAGES}}
                for j, d in zip(jobs, deltas)]
    means = {s: {k: _mean(e.get(k) for e in stage[s]) for k in ("reward", *keys, "greedy_reward")} for s in STAGES}
    return {"summary": summary, "per_seed": per_seed, "stage_means": means}


def _fmt(x) -> str:
    return "n/a" if _finite(x) is None else f"{x:.3f}"


def _row(seed, stage: str, e: dict, keys: tuple[str, ...]) -> str:
    cells = [str(seed), stage, _fmt(e["reward"]), *(_fmt(e[k]) for k in keys), _fmt(e["greedy_reward"])]
    return "| " + " | ".join(cells) + " |"


def report(result: dict, keys: tuple[str, ...]) -> str:
    s, cfg, env = result["summary"], result["config"], result["environment"]
    lines = [
        f"# {cfg['agent']}: base -> SFT -> GRPO ({env.get('gpu', cfg['device'])}, {env['date']})", "",
        f"Command: `{result['command']}`", "",
        (f"Val set: {result['val_set']}. Demonstrations: {cfg['demos']} ({result['jobs'][0]['demos']} lines), "
         f"{cfg['sft_epochs']} epoch(s) at lr {cfg['sft_lr']:g}; then up to {cfg['steps']} GRPO steps of "
         f"{cfg['groups_per_step']} groups x {cfg['group_size']} at lr {cfg['lr']:g}. Wall {result['wall_s']} s."), "",
        "| " + " | ".join(["seed", "stage", "val reward", *keys, "greedy reward"]) + " |",
        "|" + "---|" * (len(keys) + 4),
        *(_row(p["seed"], st, p[st], keys) for p in result["per_seed"] for st in STAGES),
        *(_row("mean", st, result["stage_means"][st], keys) for st in STAGES), "",
        "Summary: " + ", ".join(f"{k} {v if k == 'seeds' else _fmt(v)}" for k, v in s.items()) + ".",
        (f"GRPO steps done per seed: {[p['steps_done'] for p in result['per_seed']]}; failed jobs: "
         f"{result['failed_jobs'] or 'none'}."), ""]
    return "\n".join(lines)


def _point(e: dict, key: str) -> float:
    """A plotted value; a missing one (NaN) leaves a gap in the line."""
    return math.nan if _finite(e.get(key)) is None else e[key]


def plot(jobs: list[dict], path: Path, title: str, curve: str) -> None:
    fig, (ax1, ax2) = loop.two_panels()
    for j in jobs:
        color = f"C{j['seed'] % 10}"
        for ax, key in ((ax1, "reward"), (ax2, curve)):
            ax.plot([e["step"] for e in j["evals"]], [_point(e, key) for e in j["evals"]], "o-", color=color,
                    label=f"seed {j['seed']}")
            ax.plot([-1], [_point(j["stages"]["base"], key)], "s", color=color, markersize=8)
            ax.plot([0], [_point(j["stages"]["sft"], key)], "D", color=color, markersize=8)
    for ax, label in ((ax1, "val mean reward (sampled)"), (ax2, f"val {curve}")):
        ax.set(xlabel="GRPO step (-1: base model, square; 0: after SFT, diamond)", ylabel=label)
    loop.save_figure(fig, (ax1, ax2), path, title, legend_size=7)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    loop.common_arguments(ap, out="benchmarks/results/learning_research_h200")
    ap.add_argument("--agent", choices=sorted(AGENTS), default="research")
    ap.add_argument("--agent-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of the agent (repeatable), e.g. max_turns=4")
    ap.add_argument("--lr", type=float, default=1e-4, help="GRPO learning rate")
    ap.add_argument("--val-size", type=int, default=0, help="evaluate on the first N val scenarios (0: all)")
    ap.add_argument("--demos", default=None, help="demonstrations JSONL (default configs/demos/<agent>-train.jsonl)")
    ap.add_argument("--sft-count", type=int, default=0, help="train on the first N demonstrations (0: all)")
    ap.add_argument("--sft-epochs", type=int, default=2)
    ap.add_argument("--sft-lr", type=float, default=2e-4, help="on the CPU, 8 steps at 1e-3 took SmolLM2 from never "
                    "opening a turn with a tool call to about half its turns (configs/research.yaml)")
    ap.add_argument("--sft-batch-size", type=int, default=8)
    ap.set_defaults(steps=20, group_size=8, groups_per_step=16, eval_every=5, eval_samples=4, max_seq_len=None)
    args = ap.parse_args()
    args.demos = args.demos or str(loop.REPO / "configs" / "demos" / f"{args.agent}-train.jsonl")
    args.max_seq_len = args.max_seq_len or AGENTS[args.agent].max_seq_len
    handled = loop.job_main(args, _run_job)
    if handled is not None:
        return handled

    t0 = time.perf_counter()
    specs = [(s, args.lr) for s in args.seeds]
    model_dir, model_info, jobs, failed = loop.run_jobs(__file__, args, specs, _run_job)
    if not jobs:
        print("every job failed: " + "; ".join(failed))
        return 1
    from agents.registry import get_agent

    spec = AGENTS[args.agent]
    n_val = len(val_set(get_agent(args.agent, **agent_options(args.agent_option)), args.val_size))
    result = {
        **summarise(jobs, spec.keys),
        "command": "python benchmarks/learning_research_gpu.py " + " ".join(sys.argv[1:]),
        "val_set": f"{'the first ' + str(n_val) + ' of ' if args.val_size else 'all '}the {args.agent} val split "
                   f"(seed-0 order; {n_val} scenarios), {args.eval_samples} sampled + 1 greedy rollout each",
        "config": {k: getattr(args, k) for k in ("agent", "agent_option", "device", "seeds", "lr", "steps",
                                                 "group_size", "groups_per_step", "lora_rank", "eval_every",
                                                 "eval_samples", "val_size", "max_seq_len", "demos", "sft_count",
                                                 "sft_epochs", "sft_lr", "sft_batch_size", "time_budget_s")},
        "model_info": model_info, "environment": loop.environment(args.device),
        "wall_s": round(time.perf_counter() - t0, 1), "failed_jobs": failed, "jobs": jobs,
    }
    result = _clean(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(report(result, spec.keys))
    plot(result["jobs"], out.with_suffix(".png"), f"{args.agent} / {Path(model_dir).name}: base, SFT "
         f"({args.sft_epochs} ep), {args.steps} GRPO steps, group {args.group_size} x {args.groups_per_step}, "
         f"device {args.device}", spec.curve)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
