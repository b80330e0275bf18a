"""Base-model baselines of the example agents: rollouts on the val split through the real inference path.

Starts the embedded server (`backends.serving.app.start_server`) on the chosen model, talks to it with the
trajflow policy client (the same `openai` client the flow uses: logprobs, token ids and per-request seeds
injected), runs each val scenario `--samples` times at the agent's temperature 1.0 and once greedy
(temperature 0), and prints mean reward and every numeric metric. Seeds are derived from the scenario,
so a rerun on the same machine samples the same tokens.

    .venv/bin/python -m benchmarks.agent_baselines --agent arithmetic --model smollm2-135m --scenarios 80
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from collections import defaultdict

from agents.client import policy_client, rollout_context, rollout_seed_material
from agents.registry import get_agent


async def _evaluate(agent, client, policy: str, scenarios, samples: int, label: str, concurrency: int):
    sem = asyncio.Semaphore(concurrency)

    async def one(scenario, index):
        async with sem:
            with rollout_context(rollout_seed_material(f"baseline-{label}", 0, scenario.id, index)):
                return await agent.rollout(client, policy, scenario)

    trajs = await asyncio.gather(*(one(s, i) for s in scenarios for i in range(samples)))
    metrics: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        metrics["reward"].append(t.reward)
        for k, v in t.metrics.items():
            metrics[k].append(float(v))
    return {k: round(statistics.fmean(v), 4) for k, v in metrics.items()}, trajs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agent", default="arithmetic")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--scenarios", type=int, default=80, help="val scenarios (first N of seed 0's order)")
    p.add_argument("--samples", type=int, default=2, help="sampled rollouts per scenario at temperature 1")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--by", default=None, help="also break the mean reward down by this metadata key")
    p.add_argument("--option", action="append", default=[], help="agent option key=JSON, repeatable")
    args = p.parse_args()

    from backends.serving.app import start_server

    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    sampled_agent = get_agent(args.agent, **options)
    greedy_agent = get_agent(args.agent, **{**options, "temperature": 0.0})
    scenarios = sampled_agent.scenarios("val", seed=0)[: args.scenarios]
    t0 = time.time()
    with start_server(args.model) as server:
        policy = server.engine.name

        async def both():
            client = policy_client(server.base_url, max_retries=0)
            g = await _evaluate(greedy_agent, client, policy, scenarios, 1, "greedy", args.concurrency)
            s = await _evaluate(sampled_agent, client, policy, scenarios, args.samples, "sampled", args.concurrency)
            await client.close()
            return g, s

        (greedy, gtrajs), (sampled, strajs) = asyncio.run(both())
    print(json.dumps({"agent": args.agent, "model": args.model, "options": options, "val_scenarios": len(scenarios),
                      "sampled_per_scenario": args.samples, "greedy": greedy, "sampled_t1": sampled,
                      "seconds": round(time.time() - t0, 1), "python": platform.python_version()}, indent=1))
    if args.by:
        for label, trajs in (("greedy", gtrajs), ("sampled_t1", strajs)):
            groups: dict[str, list[float]] = defaultdict(list)
            for t in trajs:
                groups[str(t.metadata.get(args.by))].append(t.reward)
            print(label, "reward by", args.by, {k: round(statistics.fmean(v), 3) for k, v in sorted(groups.items())})
    for t in gtrajs[:5]:
        print("greedy example:", t.logs[-1] if t.logs else t.messages()[-1])


if __name__ == "__main__":
    main()
