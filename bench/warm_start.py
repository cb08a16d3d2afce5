"""Warm-start step time by curriculum: one padded batch against `pretrain_micro_batches` length-sorted groups.

    python bench/warm_start.py [--configs search_agent.yaml gigpo_grid.yaml ...] [--micro-batches 4] [--steps 6]

Each config's embedded model (untrained, its own shape) takes `--steps` batches of its curriculum, forward and
backward on one thread, first in one padded batch, then in the groups; it prints seconds a step, the padding's
efficiency (real tokens / padded tokens) and the ratio. The last line is one JSON object."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = ["search_agent.yaml", "gigpo_grid.yaml", "gigpo_grid_pits.yaml", "calculator_agent.yaml",
           "gsm8k_multi_turn.yaml", "gsm8k_reflection.yaml", "tiny_cpu.yaml"]


def seconds_a_step(model, tokenizer, batches, micro_batches: int) -> tuple[float, float]:
    from areal_pipeline.warm_start import _accumulate_by_length, _padded

    started, real, padded = time.perf_counter(), 0, 0
    for rows, targets in batches:
        size = -(-len(rows) // micro_batches)
        lengths = sorted(map(len, rows))
        groups = [lengths[i:i + size] for i in range(0, len(lengths), size)]
        real, padded = real + sum(lengths), padded + sum(len(g) * g[-1] for g in groups)
        if micro_batches == 1:
            model(**_padded(tokenizer, rows, targets)).loss.backward()
        else:
            _accumulate_by_length(model, tokenizer, rows, targets, micro_batches)
        model.zero_grad()
    return (time.perf_counter() - started) / len(batches), real / padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    import torch
    from transformers import Qwen2ForCausalLM

    from areal_pipeline.model import build_byte_tokenizer, tiny_qwen2_config
    from areal_pipeline.run_spec import load_config
    from areal_pipeline.warm_start import curriculum

    torch.set_num_threads(1)  # as warm_start runs
    tokenizer, results = build_byte_tokenizer(), {}
    for name in args.configs:
        tiny = load_config(Path(__file__).resolve().parents[1] / "configs" / name, ["output_dir=/tmp/unused"]).model.tiny
        torch.manual_seed(1)
        model = Qwen2ForCausalLM(tiny_qwen2_config(tokenizer, tiny)).train()
        sample, rng = curriculum(tiny.pretrain_task)(tokenizer, tiny, 1), random.Random(1)
        batches = [tuple(zip(*sample(rng, tiny.pretrain_batch_size))) for _ in range(args.steps)]
        seconds_a_step(model, tokenizer, batches[:1], 1)  # first-call costs out of the timing
        one, one_efficiency = seconds_a_step(model, tokenizer, batches, 1)
        grouped, grouped_efficiency = seconds_a_step(model, tokenizer, batches, args.micro_batches)
        results[name] = {"s_per_step": round(one, 3), "s_per_step_grouped": round(grouped, 3),
                         "padding_efficiency": round(one_efficiency, 2),
                         "padding_efficiency_grouped": round(grouped_efficiency, 2),
                         "speedup": round(one / grouped, 2), "configured": tiny.pretrain_micro_batches}
        print(f"{name}: {one:.3f} s/step in one batch (padding efficiency {one_efficiency:.2f}), {grouped:.3f} s/step "
              f"in {args.micro_batches} groups ({grouped_efficiency:.2f}): {one / grouped:.2f}x; "
              f"configured {tiny.pretrain_micro_batches}", flush=True)
    print(json.dumps({"micro_batches": args.micro_batches, "steps": args.steps, "configs": results}))


if __name__ == "__main__":
    main()
