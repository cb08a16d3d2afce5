"""A simulated user of a line's served champion (docs/online.md): not part of any run, a stand-in for the people
and programs that would send it requests. It asks arithmetic questions of the embedded default through the OpenAI
SDK, checks each answer itself as a user would (the task's own reward: 1 for the right number, 0 otherwise) and
posts that as feedback for a share of the answers; the rest get none (and wait, then expire, unrewarded).

    python examples/simulated_user.py --config configs/online_cpu.yaml --questions 192 --asks 4 --feedback 0.75

Each question is asked `--asks` times (separate requests, as several users asking the same thing would), so that
firings can group the answers of one prompt. Questions come from the generator's train split, never the gate's
test questions, seeded by `--round` (the same round on another machine asks the same questions). The servers are
the line's own (its servers.json, while `areal-pipeline serve --recurring` runs them) unless `--address` names one.
The last line printed is one JSON object: requests, answers right, feedback posted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the line's config (e.g. configs/online_cpu.yaml)")
    p.add_argument("overrides", nargs="*", help="the line's config overrides, as `recurring fire` takes them")
    p.add_argument("--address", default="", help="a server host:port (default: the line's own servers)")
    p.add_argument("--questions", type=int, default=192)
    p.add_argument("--asks", type=int, default=4, help="requests per question")
    p.add_argument("--feedback", type=float, default=0.75, help="share of questions whose answers get feedback")
    p.add_argument("--round", type=int, default=1, help="seeds the questions and the feedback share")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    return p.parse_args(argv)


async def simulate(args: argparse.Namespace) -> dict:
    import httpx
    from openai import AsyncOpenAI

    from areal_pipeline import auth
    from areal_pipeline.config import DatasetConfig
    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.recurring.line import Line
    from areal_pipeline.rewards.math import math_reward
    from areal_pipeline.run_spec import load_config

    cfg = load_config(args.config, args.overrides)
    token = auth.ensure_run_token(cfg.output_dir) or "none"
    addresses = [args.address] if args.address else Line(cfg).announced_servers()
    if not addresses:
        raise SystemExit(f"line {Line(cfg).name} serves on no server now: start `areal-pipeline serve --config "
                         f"{args.config} --recurring` (recurring.serve.num_servers >= 1), or give --address")
    source = DatasetConfig(**{**vars(cfg.dataset), "path": ""})
    records = load_records(source, source.train_split, cfg.seed)
    rng = random.Random(f"simulated-user/{args.round}")
    questions = [rng.choice(records) for _ in range(args.questions)]
    rated = {i for i in range(len(questions)) if rng.random() < args.feedback}
    gconfig = cfg.rollout.gconfig
    clients = [AsyncOpenAI(base_url=auth.url(a, "/v1"), api_key=token, timeout=args.timeout, max_retries=2)
               for a in addresses]
    http = httpx.AsyncClient(timeout=args.timeout, headers={"Authorization": f"Bearer {token}"})
    limit = asyncio.Semaphore(args.concurrency)
    tally = {"requests": 0, "right": 0, "feedback": 0}

    async def ask(i: int, record: dict, j: int) -> None:
        client = clients[(i * args.asks + j) % len(clients)]
        async with limit:
            reply = await client.chat.completions.create(
                model="champion", messages=record["messages"], max_tokens=gconfig.max_new_tokens,
                temperature=gconfig.temperature, top_p=gconfig.top_p,
                metadata={"conversation_id": f"round{args.round}-q{i}-a{j}"})
            reward = math_reward(reply.choices[0].message.content or "", record["answer"])
            tally["requests"] += 1
            tally["right"] += int(reward >= 1)
            if i in rated:
                answer = await http.post(str(client.base_url).rstrip("/") + "/feedback",
                                         json={"response_id": reply.id, "reward": reward})
                answer.raise_for_status()
                tally["feedback"] += 1

    try:
        await asyncio.gather(*(ask(i, r, j) for i, r in enumerate(questions) for j in range(args.asks)))
    finally:
        await http.aclose()
        for client in clients:
            await client.close()
    return {**tally, "pass_rate": round(tally["right"] / max(1, tally["requests"]), 4), "round": args.round,
            "servers": addresses}


def main(argv=None) -> None:
    print(json.dumps(asyncio.run(simulate(parse_args(argv)))), flush=True)


if __name__ == "__main__":
    main()
