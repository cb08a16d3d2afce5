"""Trying a workflow before training, as the tutorials do with `rollout_batch(sample_data, workflow)`.

`try_workflow` starts what the config's workflow needs (its inference servers with the config's model, and
the retrieval server for the search agent), runs `n` episodes on the first `n` prompts of an iteration's
batch (each a group of `rollout.gconfig.n_samples` episodes, with the baseline episode the config's advantage asks
for), stops the servers and returns the trajectories.
Nothing is cached or written but the servers' logs: every call rolls out afresh. `format_episode` decodes one
trajectory for people: the prompt, each turn with its role (tool results marked), the reward.

    from areal_pipeline.rollout.try_workflow import format_episode, tokenizer_for, try_workflow
    from areal_pipeline.run_spec import load_config

    cfg = load_config("configs/search_agent.yaml", ["rollout.gconfig.n_samples=1"])
    trajectories = try_workflow(cfg, 2)
    for t in trajectories:
        print(format_episode(t, tokenizer_for(cfg)))

The same from the command line: `areal-pipeline rollout --config configs/search_agent.yaml --show 2`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from areal_pipeline.data.trajectory import Trajectory


def try_workflow(cfg, n: int = 4, *, iteration: int = 1, records: Optional[list[dict[str, Any]]] = None,
                 log_dir: Optional[Path] = None, progress: bool = False) -> list[Trajectory]:
    """Run `n` episodes of `cfg`'s workflow with freshly started servers; returns their trajectories in order.

    The prompts are the first `n` of iteration `iteration`'s batch (with the sampling seeds the training run
    gives them), or `records` (data set rows: `prompt_id`, `messages`, `answer`, ...) when given. The policy is
    the config's model (version 0); for `iteration` k > 1 the servers get the run's policy k - 1 from its
    checkpoints, as `areal-pipeline rollout --iteration k` does (that starts the trainer too)."""
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import run_lock
    from areal_pipeline.rollout.executor import episode_seed, run_episodes
    from areal_pipeline.utils import run_async

    if n < 1:
        raise ValueError(f"try_workflow: n must be at least 1, got {n}")
    pipeline = Pipeline(cfg, log_dir=log_dir or cfg.run_dir / "logs" / "try")
    try:
        pipeline.prepare_dataset()
        if records is None:
            episodes = pipeline._episodes(iteration)[:n]
        else:
            episodes = [{"sampling_seed": episode_seed(cfg.seed, iteration, str(r.get("prompt_id", i))), **r}
                        for i, r in enumerate(records[:n])]
        pipeline.services.start_tools()
        pipeline.services.start_inference()
        if iteration > 1:
            with run_lock(cfg.run_dir):  # the run's weights directory is written by the push
                pipeline.services.start_trainer()  # it loads the run's checkpoint of that version
                pipeline.sync_servers(iteration - 1)
        workflow, baseline = pipeline._workflow(), pipeline._baseline_workflow()

        async def run():
            async with pipeline._engine() as engine:
                return await run_episodes(workflow, engine, episodes,
                                          max_concurrent_rollouts=cfg.rollout.max_concurrent_rollouts,
                                          n_samples=cfg.rollout.gconfig.n_samples, baseline=baseline,
                                          progress=progress)
        return run_async(run())
    finally:
        pipeline.close()
        pipeline.services.stop()


def tokenizer_for(cfg):
    """The tokenizer of the config's model (the embedded one is built, or taken from the model cache)."""
    from areal_pipeline.model import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(cfg.model, cfg.output_dir, cfg.seed), cfg.model.trust_remote_code)


def episode_turns(t: Trajectory, tokenizer=None) -> list[tuple[str, str]]:
    """(role, text) for the prompt's messages and then each turn after it. A workflow that records every turn
    as a message (reflection, multi_turn) is shown from its messages (the environment's feedback is a `user`
    turn); one that records the completion as one message (rlvr, search_agent) is split at the
    trajectory's model / environment token boundaries, and an environment segment is a `tool` turn."""
    first = next((i for i, m in enumerate(t.messages) if m["role"] == "assistant"), len(t.messages))
    turns = [(m["role"], m["content"]) for m in t.messages[:first]]
    later = [(m["role"], m["content"]) for m in t.messages[first:]]
    if sum(role == "assistant" for role, _ in later) > 1 or tokenizer is None or not t.input_ids:
        return turns + (later or [("assistant", t.text)])
    start = t.loss_mask.index(1) if 1 in t.loss_mask else len(t.loss_mask)
    segments: list[tuple[int, list[int]]] = []
    for token, mask in zip(t.input_ids[start:], t.loss_mask[start:]):
        if segments and segments[-1][0] == mask:
            segments[-1][1].append(token)
        else:
            segments.append((mask, [token]))
    for mask, ids in segments:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        turns.append(("assistant" if mask else "tool", text))
    return turns


QUIET_METADATA = ("latency", "server")  # the server's timing and address: no facts about the episode


def format_episode(t: Trajectory, tokenizer=None, index: Optional[int] = None) -> str:
    """One trajectory (of episode `index`) as text: a header (prompt id, sample, reward, stop reason, turns), the prompt and each
    turn with its role, tool results marked, then the workflow's facts (the answer...) and the baseline's reward."""
    head = f"episode {index}, " if index is not None else ""
    lines = [f"=== {head}sample {t.sample_idx} (prompt {t.prompt_id}): reward {t.reward:g}, "
             f"stop {t.stop_reason or '-'}, {t.num_turns} turn(s), {t.num_generated} generated tokens"]
    marks = {"tool": "[tool result]", "user": "[user]", "system": "[system]", "assistant": "[assistant]"}
    for role, text in episode_turns(t, tokenizer):
        body = text.strip("\n").replace("\n", "\n    ")
        lines.append(f"  {marks.get(role, f'[{role}]')} {body}")
    facts = {k: v for k, v in t.metadata.items() if k not in QUIET_METADATA and len(repr(v)) <= 120
             and (isinstance(v, (bool, int, float, str)) or k == "answer")}  # the reference answer(s) too
    if t.baseline_reward is not None:  # the reward of the prompt's baseline episode (ReMax's greedy one)
        facts["baseline_reward"] = t.baseline_reward
    if facts:
        lines.append("  facts: " + ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v!r}"
                                            for k, v in facts.items()))
    return "\n".join(lines)
