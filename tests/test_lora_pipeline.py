"""trainer.lora with the rest of the pipeline: asynchronous training, the episode failure policy and the OpenAI-SDK
agent, each through a real run (the project's servers, the torchrun trainer, real shards) where every push sends the
adapter alone, loaded under a name per version, and is verified against the trainer."""

from __future__ import annotations

import logging
import math
import re
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from _learning_helpers import REPO, short_run
from _rollouts import journaled_positions
from areal_pipeline.data.shards import read_manifest, read_table, read_trajectories
from areal_pipeline.model import load_model
from areal_pipeline.training.losses import gather_logprobs

# the CPU default's LoRA rate (docs/lora.md); the random tiny model these runs start from needs no warm start to
# generate the long answers that a push interrupts
LORA = ("trainer.lora.enabled=true", "trainer.optimizer.lr=3e-3")
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]
# eight groups of four long generations, eight episodes at a time: a rollout lasts a few waves
LONG_GENERATIONS = ("rollout.batch_size=8", "rollout.gconfig.n_samples=4", "rollout.max_concurrent_rollouts=8",
                    "rollout.gconfig.max_new_tokens=200", "dataset.arithmetic_train_size=64")


@pytest.fixture
def pushes(monkeypatch) -> list[tuple[int, str, list[str]]]:
    """Every weight push of the run as it leaves for the servers: (version, the adapter name it loads, the files of
    the directory it sends). The push itself is the real one."""
    from areal_pipeline.inference.client import RemoteSGLangEngine

    seen: list[tuple[int, str, list[str]]] = []
    push = RemoteSGLangEngine.update_weights_from_disk

    async def recorded(engine, path, version):
        name = engine.adapter.name_for(version) if engine.adapter is not None else None
        seen.append((version, name, sorted(p.name for p in Path(path).iterdir())))
        await push(engine, path, version)
    monkeypatch.setattr(RemoteSGLangEngine, "update_weights_from_disk", recorded)
    return seen


def verified_versions(caplog) -> list[int]:
    return [int(m.group(1)) for r in caplog.records
            if (m := re.match(r"servers verified at version (\d+)", r.getMessage()))]


def assert_adapter_pushes_verified(pushes, caplog, versions: list[int]) -> None:
    """The run pushed `versions`, in order, each the adapter alone under its version's name, each verified."""
    assert pushes == [(v, f"policy-v{v}", ADAPTER_FILES) for v in versions], pushes
    assert verified_versions(caplog) == versions


def generated_versions(trajectory) -> list[int]:
    return [v for v, m in zip(trajectory.versions, trajectory.loss_mask) if m]


def test_asynchronous_lora_training_resumes_interrupted_generations_on_the_new_adapter(tiny_model_dir, tmp_path,
                                                                                       caplog, pushes):
    """rollout.max_head_offpolicyness=1 with LoRA: iteration k+1's rollout generates while update k trains, and the
    push of adapter k interrupts generations that then go on under it; every token keeps the version of the adapter
    that produced it (the merged policy of its checkpoint gives its logprob), within the staleness bound; the
    reference logprobs (kl_ctl > 0) are the base's."""
    caplog.set_level(logging.INFO, logger="areal_pipeline")
    eta, iterations = 1, 3
    cfg, records = short_run("tiny_cpu.yaml", tmp_path, f"model.path={tiny_model_dir}", *LORA, *LONG_GENERATIONS,
                             f"rollout.max_head_offpolicyness={eta}", f"total_iterations={iterations}",
                             "ppo.kl_ctl=0.05", "save_freq=1", f"keep_checkpoints={iterations}")
    assert [r["iteration"] for r in records] == list(range(1, iterations + 1))
    # the servers start on the base (version 0, no adapter); each update's adapter is pushed once, by its broadcast
    assert_adapter_pushes_verified(pushes, caplog, list(range(1, iterations + 1)))

    assert max(r["staleness"] for r in records) == eta
    assert all(math.isfinite(r["loss"]) and r["behave_imp_weight"] is not None for r in records)
    # the KL term is the behaviour policy's against the reference (the base): 0 on tokens the base generated
    # (iteration 1's, and iteration 2's where no push met them: timing decides), and above 0 from iteration 3 on,
    # whose tokens the staleness bound has come from adapter 1 or later
    kl = [r["kl"] for r in records]
    assert abs(kl[0]) < 1e-6 and kl[2] > 1e-4, kl
    iteration_2 = [v for t in read_trajectories(cfg.run_dir / "iter_2" / "rollout") for v in generated_versions(t)]
    if not any(v >= 1 for v in iteration_2):
        assert abs(kl[1]) < 1e-6, kl

    mixed = []
    for k in range(1, iterations + 1):
        for t in read_trajectories(cfg.run_dir / f"iter_{k}" / "rollout"):
            generated = generated_versions(t)
            assert generated == sorted(generated)  # a generation only moves to newer adapters
            assert (k - 1) - generated[0] <= eta and generated[-1] <= k - 1, (k, generated)
            if generated[0] != generated[-1]:
                mixed.append(t)
    # timing decides which generations a push meets; with long ones running whenever it lands, some always are
    assert mixed, "no trajectory spanned a push"

    # each segment of a trajectory that spans a push was generated by its version's policy: the base, or the base
    # with that version's adapter merged (the checkpoint's model/)
    base = load_model(tiny_model_dir)
    t = mixed[0]
    ids = torch.tensor([t.input_ids])
    for version in sorted(set(generated_versions(t))):
        model = base if version == 0 else load_model(cfg.run_dir / "checkpoints" / f"step_{version}" / "model")
        with torch.no_grad():
            expected = gather_logprobs(model(ids).logits[0, :-1], ids[0, 1:])
        positions = [i for i, (v, m) in enumerate(zip(t.versions, t.loss_mask)) if m and v == version]
        got = torch.tensor([t.logprobs[i] for i in positions])
        assert torch.allclose(got, expected[[i - 1 for i in positions]], atol=1e-3), version

    # and the reference logprobs the KL term used are the base's, not the actor's
    ref = pq.read_table(cfg.run_dir / f"iter_{iterations}" / "ref_logprobs.parquet").column("logprobs").to_pylist()
    rows = read_table(cfg.run_dir / f"iter_{iterations}" / "rollout", schema=None).column("input_ids").to_pylist()
    for row, values in list(zip(rows, ref))[:2]:
        with torch.no_grad():
            expected = gather_logprobs(base(torch.tensor([row])).logits[0, :-1], torch.tensor(row[1:]))
        assert torch.allclose(torch.tensor(values[1:]), expected, atol=1e-5)


def test_a_server_killed_mid_rollout_comes_back_with_the_adapter_and_the_run_goes_on(tiny_model_dir, tmp_path,
                                                                                      caplog, pushes):
    """SIGKILL of the inference server in the middle of iteration 2's rollout, with adapter 1 served: the episodes
    that met it fail, the first retry restarts it (at the base, version 0) and pushes adapter 1 to it again, verified,
    and they play again on it; no episode is lost and the run goes on to its end."""
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import run_lock
    from areal_pipeline.run_spec import load_config
    from test_flows import wait_until

    caplog.set_level(logging.INFO, logger="areal_pipeline")
    iterations = 2
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [
        f"output_dir={tmp_path}", f"model.path={tiny_model_dir}", "eval_freq=0", *LORA, *LONG_GENERATIONS,
        f"total_iterations={iterations}", "rollout.journal_delay=0",  # its groups on disk as they end: the signal
        # a request to the dead server fails its episode at once, rather than after the client's own retries: the
        # episode's retries (rollout.episode_retries, the default failure policy) are what recover it
        "inference.request_retries=0"])
    pipeline = Pipeline(cfg)
    killed: list[int] = []

    def kill_mid_rollout():
        # iteration 2's first groups are on disk (the groups are played a few at a time): the others are generating
        wait_until(lambda: journaled_positions(pipeline.paths.episodes(2)), 300, "iteration 2's first group",
                   interval=0.01)
        server = pipeline.services.inference[0]
        killed.append(server.popen.pid)
        server.popen.kill()  # SIGKILL

    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            killer = threading.Thread(target=kill_mid_rollout, daemon=True)
            killer.start()
            records = pipeline.run_iterations(1, iterations)
            killer.join(10)
            assert killed and pipeline.services.inference[0].popen.pid != killed[0]
            pipeline.services.forget_served()
            assert pipeline.server_versions() == [iterations]  # asked again: the restarted server serves the last
        finally:
            pipeline.close()
            pipeline.services.stop()
    assert [r["iteration"] for r in records] == list(range(1, iterations + 1))
    # adapter 1 twice: broadcast 1, then to the restarted server; each verified there
    assert_adapter_pushes_verified(pushes, caplog, [1, 1, 2])
    assert any(re.match(r"inference server\(s\) 127\.0\.0\.1:\d+ died; restarting", r.getMessage())
               for r in caplog.records)
    manifest = read_manifest(pipeline.paths.rollout(2))
    stats = manifest["stats"]
    assert manifest["failures"] == [] and (stats["failure_rate"], stats["groups_dropped"]) == (0.0, 0), manifest
    assert stats.get("retries/inference", 0) >= 1 and stats["num_trajectories"] == 32, stats
    # every token of iteration 2, before the kill and after it, came from adapter 1: the restarted server generated
    # nothing before it had it again
    assert {v for t in read_trajectories(pipeline.paths.rollout(2)) for v in generated_versions(t)} == {1}


def test_the_openai_sdk_agent_trains_with_lora_adapter_pushes(tiny_model_dir, tmp_path, caplog, pushes):
    """examples/calculator_agent.py (configs/calculator_agent.yaml, shrunk) with LoRA: the agent's completions, sent
    through the OpenAI client the workflow hands it, name the served adapter, and iteration 2's were generated by
    adapter 1."""
    caplog.set_level(logging.INFO, logger="areal_pipeline")
    cfg, records = short_run("calculator_agent.yaml", tmp_path, f"model.path={tiny_model_dir}", *LORA,
                             "total_iterations=2", "rollout.batch_size=2", "rollout.gconfig.n_samples=2",
                             "rollout.gconfig.max_new_tokens=8")
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert_adapter_pushes_verified(pushes, caplog, [1, 2])
    for k in (1, 2):
        episodes = read_trajectories(cfg.run_dir / f"iter_{k}" / "rollout")
        assert len(episodes) == 4 and all(t.metadata["completion_ids"] and sum(t.loss_mask) for t in episodes)
        # a server with an adapter loaded refuses requests that do not name it: iteration 2's completions named
        # adapter 1, and it generated every token of them
        assert {v for t in episodes for v in generated_versions(t)} == {k - 1}
