"""Corrupt files get clear errors, and nothing corrupt is trained on or served: checkpoints carry checksums.json,
shards their manifest's sha256s, and every reader checks them. Real files, a real CPU server and a real 2-rank
trainer (torchrun, gloo), driven through `Pipeline` as the flows drive it."""

from __future__ import annotations

import json
import logging
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch

from areal_pipeline.checksums import CHECKSUMS_NAME, IntegrityError, verify_checksums
from areal_pipeline.run_spec import load_config
from areal_pipeline.data.shards import (CorruptShardError, ShardError, is_complete, part_files, read_manifest,
                                        read_table, read_trajectories, verify_shards)
from areal_pipeline.evaluation import evaluate_checkpoint, resolve_checkpoint
from areal_pipeline.pipeline import Pipeline
from areal_pipeline.run_dir import run_lock
from areal_pipeline.training.client import TrainerClient, TrainerError
from areal_pipeline.training.batches import read_batch
from test_trainer import weights


def flip_byte(path: Path) -> None:
    """One byte in the middle changed, the size kept: only a checksum can tell."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path, lost: int = 10) -> int:
    data = path.read_bytes()
    path.write_bytes(data[:-lost])
    return len(data)


def shard(directory: Path) -> Path:
    return Path(part_files(directory)[0])


@contextmanager
def library_warnings() -> Iterator[list[str]]:
    """The warnings the library logs inside the block. Read off its own logger: once Prefect's logging is set up
    (`flows` asks it to take over the `areal_pipeline` loggers), they no longer reach pytest's caplog."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("areal_pipeline")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


@dataclass
class Run:
    pipeline: Pipeline
    reference: Path  # the weights of version 3 as the uninterrupted run reached them
    backup: Path

    @property
    def paths(self):
        return self.pipeline.paths

    @property
    def trainer(self) -> TrainerClient:
        return self.pipeline.services.trainer_client

    def restore_files(self) -> None:
        """The run's outputs as the three iterations wrote them (tests corrupt them)."""
        for saved in self.backup.iterdir():
            shutil.rmtree(self.paths.run_dir / saved.name, ignore_errors=True)
            shutil.copytree(saved, self.paths.run_dir / saved.name)

    def trainer_weights(self, name: str) -> dict[str, torch.Tensor]:
        out = self.backup.parent / name
        self.trainer.call("save_weights", path=str(out))
        return weights(out)


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory):
    """Three real iterations (CPU inference server, 2-rank trainer) that saved checkpoint 2; the weights of
    version 3 kept as the reference."""
    root = tmp_path_factory.mktemp("integrity")
    cfg = load_config(None, [f"output_dir={root / 'out'}", f"model.path={tiny_model_dir}", "run_id=integrity",
                             "total_iterations=4", "save_freq=2", "eval_freq=0", "trainer.nproc=2",
                             "rollout.batch_size=4", "rollout.gconfig.n_samples=2", "dataset.arithmetic_train_size=64"])
    pipeline = Pipeline(cfg)
    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            pipeline.run_iterations(1, 3)
            assert pipeline.paths.saved_checkpoints() == [2]
            # beside the run, in its output_dir: where the trainer may write (confined_paths.py)
            run = Run(pipeline, root / "out" / "reference", root / "out" / "backup")
            run.trainer.call("save_weights", path=str(run.reference))
            for name in ("iter_1", "iter_2", "iter_3", "checkpoints"):
                shutil.copytree(cfg.run_dir / name, run.backup / name)
            yield run
        finally:
            pipeline.close()
            pipeline.services.stop()


@pytest.fixture
def run(trained_run) -> Run:
    trained_run.restore_files()
    return trained_run


# ----- checkpoints -----------------------------------------------------------------------------------------
def test_a_checkpoint_lists_every_file_in_its_manifest_and_loads_when_intact(run):
    checkpoint = run.paths.checkpoint(2)
    listed = json.loads((checkpoint / CHECKSUMS_NAME).read_text())["files"]
    on_disk = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
    assert set(listed) == on_disk - {CHECKSUMS_NAME}
    assert {"model/model.safetensors", "model/config.json", "optimizer.safetensors",
            "trainer_state.json"} <= listed.keys()
    assert listed["optimizer.safetensors"]["bytes"] == (checkpoint / "optimizer.safetensors").stat().st_size
    run.trainer.call("reinitialize")
    assert run.trainer.call("load", path=str(checkpoint))["version"] == 2


def test_a_corrupt_checkpoint_is_refused_by_the_trainer_naming_the_file(run):
    run.trainer.call("reinitialize")
    copies = run.backup.parent / "corrupt-copies"  # in the run's output_dir: where the trainer may read
    copies.mkdir(exist_ok=True)

    def refused(corrupt, expected: str) -> None:
        copy = copies / f"copy-{len(list(copies.iterdir()))}"
        shutil.copytree(run.paths.checkpoint(2), copy)
        corrupt(copy)
        with pytest.raises(TrainerError, match=expected) as error:
            run.trainer.call("load", path=str(copy))
        assert error.value.code == "corrupt_file"
        assert run.trainer.call("status")["version"] == 0  # checked on every rank before anything was loaded

    refused(lambda c: flip_byte(c / "model" / "model.safetensors"), "model/model.safetensors: sha256 mismatch")
    size = (run.paths.checkpoint(2) / "optimizer.safetensors").stat().st_size
    refused(lambda c: truncate(c / "optimizer.safetensors"),
            f"optimizer.safetensors: size {size - 10} != manifest {size}")
    refused(lambda c: (c / "model" / "tokenizer.json").unlink(), "model/tokenizer.json: missing file")
    refused(lambda c: (c / CHECKSUMS_NAME).unlink(), f"{CHECKSUMS_NAME}: missing manifest")


def test_serving_or_evaluating_a_corrupt_checkpoint_fails_naming_the_file(run, tiny_model_dir):
    cfg, checkpoint = run.pipeline.cfg, run.paths.checkpoint(2)
    assert resolve_checkpoint(cfg, "latest") == checkpoint / "model"
    assert resolve_checkpoint(cfg, str(tiny_model_dir)) == tiny_model_dir  # a user's own model: no checksums
    flip_byte(checkpoint / "model" / "model.safetensors")
    for given in ("latest", str(checkpoint), str(checkpoint / "model")):
        with pytest.raises(IntegrityError, match="model/model.safetensors: sha256 mismatch"):
            resolve_checkpoint(cfg, given)
    with pytest.raises(IntegrityError, match="model/model.safetensors: sha256 mismatch"):
        evaluate_checkpoint(cfg, checkpoint / "model")  # refused before any server starts


def test_the_checkpoint_node_saves_a_corrupt_checkpoint_again(run):
    checkpoint = run.paths.checkpoint(2)
    intact = weights(checkpoint / "model")
    assert run.pipeline.checkpoint(2)["cached"] is True
    flip_byte(checkpoint / "optimizer.safetensors")
    run.trainer.call("reinitialize")
    with library_warnings() as warnings:
        assert run.pipeline.checkpoint(2)["cached"] is False  # the trainer replays to version 2, passing it over
    assert [w for w in warnings if "optimizer.safetensors: sha256 mismatch" in w], warnings
    verify_checksums(checkpoint)
    assert all(torch.equal(value, intact[name]) for name, value in weights(checkpoint / "model").items())


def test_a_checkpoint_without_its_manifest_was_never_saved(run):
    unfinished = run.paths.checkpoint(3)  # as a save that crashed before its last file would leave it
    shutil.copytree(run.paths.checkpoint(2), unfinished)
    (unfinished / CHECKSUMS_NAME).unlink()
    assert run.paths.saved_checkpoints() == [2]
    with pytest.raises(IntegrityError, match=f"{CHECKSUMS_NAME}: missing manifest"):
        resolve_checkpoint(run.pipeline.cfg, str(unfinished))


# ----- shards ----------------------------------------------------------------------------------------------
def test_a_corrupt_batch_shard_is_named_on_read_and_the_trainer_refuses_it(run):
    batch = run.paths.batch(3)
    victim = shard(batch)
    flip_byte(victim)
    assert is_complete(batch)  # the sizes match: only the sha256 tells
    with pytest.raises(CorruptShardError, match=f"{victim}: sha256 mismatch"):
        read_batch(batch, ("input_ids", "advantages"))
    run.trainer.call("reinitialize")
    run.pipeline.ensure_trainer_version(2)
    with pytest.raises(TrainerError, match=f"{victim.name}: sha256 mismatch") as error:
        run.trainer.call("train", batch_dir=str(batch), iteration=3)
    assert error.value.code == "corrupt_file" and error.value.details["file"] == str(victim)
    assert run.trainer.call("status")["version"] == 2  # not trained on

    size = truncate(victim)
    with pytest.raises(CorruptShardError, match=f"{victim}: size {size - 10} != manifest {size}"):
        read_table(batch, schema=None)


def test_advantages_compute_a_corrupt_batch_again(run):
    from areal_pipeline.run_context import context_of
    from tasks.nodes import output_cache_key

    batch = run.paths.batch(3)
    intact = read_manifest(batch)["shards"]
    assert run.pipeline.advantages(3)["cached"] is True
    cache_key = output_cache_key(lambda paths, k: paths.batch(k))
    context = SimpleNamespace(task=SimpleNamespace(name="advantages"))
    parameters = {"run": context_of(run.pipeline).to_dict(), "k": 3}
    assert cache_key(context, parameters) is not None
    for corrupt in (flip_byte, truncate):
        corrupt(shard(batch))
        assert cache_key(context, parameters) is None  # Prefect must run the node, not serve its cached result
        with library_warnings() as warnings:
            assert run.pipeline.advantages(3)["cached"] is False
        assert [w for w in warnings if "corrupt output" in w and shard(batch).name in w], warnings
        verify_shards(batch)
        assert read_manifest(batch)["shards"] == intact  # the very same bytes again


def test_a_corrupt_rollout_is_generated_again_with_the_same_tokens(run):
    rollout = run.paths.rollout(3)
    tokens = [t.input_ids for t in read_trajectories(rollout)]
    flip_byte(shard(rollout))
    with library_warnings() as warnings:
        assert run.pipeline.rollout(3)["cached"] is False  # the servers are brought back to version 2 first
    assert [w for w in warnings if "corrupt output" in w and shard(rollout).name in w], warnings
    assert [t.input_ids for t in read_trajectories(rollout)] == tokens  # episodes are seeded


# ----- restoring the trainer's version ---------------------------------------------------------------------
def test_a_replay_passes_over_a_corrupt_checkpoint_and_never_trains_on_a_corrupt_batch(run):
    reference = weights(run.reference)
    run.trainer.call("reinitialize")
    run.pipeline.ensure_trainer_version(3)  # intact: loads checkpoint 2, replays update 3
    assert all(torch.equal(value, reference[name]) for name, value in run.trainer_weights("intact").items())

    batch_shards = read_manifest(run.paths.batch(3))["shards"]
    flip_byte(run.paths.checkpoint(2) / "model" / "model.safetensors")
    flip_byte(shard(run.paths.batch(3)))
    run.trainer.call("reinitialize")
    with library_warnings() as warnings:
        run.pipeline.ensure_trainer_version(3)  # from the initial weights, with batch 3 computed again
    assert [w for w in warnings if "passing over a corrupt checkpoint" in w and "model/model.safetensors: sha256" in w]
    assert [w for w in warnings if "not updating on a corrupt batch" in w
            and f"{shard(run.paths.batch(3)).name}: sha256 mismatch" in w], warnings
    assert read_manifest(run.paths.batch(3))["shards"] == batch_shards
    assert all(torch.equal(value, reference[name]) for name, value in run.trainer_weights("replayed").items())


def test_a_replay_over_a_corrupt_batch_whose_rollout_is_corrupt_too_fails_clearly(run):
    flip_byte(shard(run.paths.batch(3)))
    flip_byte(shard(run.paths.rollout(3)))
    run.trainer.call("reinitialize")
    with pytest.raises(ShardError, match=r"update 3 cannot run: iteration 3's batch shards .* "
                                           rf"rollout shards: .*{shard(run.paths.rollout(3))}: sha256 mismatch"):
        run.pipeline.ensure_trainer_version(3)
    assert run.trainer.call("status")["version"] == 2  # loaded checkpoint 2; never trained on the corrupt batch


def test_the_update_node_never_trains_on_a_corrupt_batch(run):
    """The batch is corrupted between the advantages node and the update: the update computes it again from the
    rollout shards first, and reaches the uninterrupted run's weights."""
    reference = weights(run.reference)
    run.pipeline.ensure_trainer_version(2)
    flip_byte(shard(run.paths.batch(3)))
    run.paths.update(3).unlink()
    with library_warnings() as warnings:
        assert run.pipeline.ppo_update(3)["cached"] is False
    assert [w for w in warnings if "not updating on a corrupt batch" in w], warnings
    assert all(torch.equal(value, reference[name]) for name, value in run.trainer_weights("updated").items())
