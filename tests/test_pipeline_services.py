"""The pipeline's services between steps: while every step succeeds, no step spends round trips asking the
trainer or the inference servers whether they are healthy or which version they hold; after a failure, or
when a process died, they are asked again and what is stale is redone."""

from __future__ import annotations

import collections

import pytest

from areal_pipeline.data.shards import ShardError
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.processes import ServerProcess
from areal_pipeline.pipeline import Pipeline
from areal_pipeline.run_dir import run_lock
from areal_pipeline.run_spec import load_config
from areal_pipeline.services import Services
from areal_pipeline.training.client import TrainerClient


@pytest.fixture
def counted(monkeypatch):
    """Counts of health checks, trainer commands and model-info requests, by kind."""
    counts: collections.Counter = collections.Counter()
    real_healthy, real_call, real_info = ServerProcess.is_healthy, TrainerClient.call, RemoteSGLangEngine.get_model_info

    def is_healthy(self, *args, **kwargs):
        counts["health"] += 1
        return real_healthy(self, *args, **kwargs)

    def call(self, cmd, *args, **kwargs):
        counts[cmd] += 1
        return real_call(self, cmd, *args, **kwargs)

    async def get_model_info(self, *args, **kwargs):
        counts["model_info"] += 1
        return await real_info(self, *args, **kwargs)

    monkeypatch.setattr(ServerProcess, "is_healthy", is_healthy)
    monkeypatch.setattr(TrainerClient, "call", call)
    monkeypatch.setattr(RemoteSGLangEngine, "get_model_info", get_model_info)
    return counts


def test_steps_trust_healthy_services_until_a_failure_or_a_death(tiny_model_dir, tmp_path, counted):
    cfg = load_config(None, [f"output_dir={tmp_path}", f"model.path={tiny_model_dir}", "total_iterations=5",
                             "rollout.batch_size=4", "rollout.gconfig.n_samples=2", "eval_freq=0", "save_freq=10",
                             "dataset.arithmetic_train_size=64"])
    pipeline = Pipeline(cfg)
    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            pipeline.run_iteration(1)
            counted.clear()
            pipeline.run_iteration(2)
            # the commands that do the work (the push verified: probe_logp), and nothing asked twice
            assert counted == {"train": 1, "save_weights": 1, "probe_logp": 1}, counted

            # a step fails: the next ones check the services and ask what they hold, once
            pipeline.paths.rollout(3).mkdir(parents=True)
            with pytest.raises(ShardError, match=r"rollout: no manifest\.json, so the shards are incomplete"):
                pipeline.advantages(3)  # iteration 3 has no rollout yet
            counted.clear()
            pipeline.rollout(3)
            assert counted["health"] == len(pipeline.services.inference) and counted["model_info"] == 1, counted
            assert counted["status"] == 0  # the rollout needs no trainer
            counted.clear()
            pipeline.advantages(3)
            pipeline.ppo_update(3)
            assert counted == {"health": 1, "status": 1, "train": 1}, counted  # the trainer's check, once

            # the inference server dies between steps: found without asking, restarted, given version 3
            server = pipeline.services.inference[0]
            server.popen.kill()
            server.popen.wait(10)
            epoch = pipeline.services.inference_epoch
            pipeline.broadcast_weights(3)
            assert pipeline.services.inference[0].popen.pid != server.popen.pid
            # the restarted server holds no weight-update group: a distributed push would join afresh
            assert pipeline.services.inference_epoch > epoch
            assert pipeline.server_versions() == [3]
            counted.clear()
            assert pipeline.sync_servers(3)["pushed"] is False
            assert counted == {}, counted
        finally:
            pipeline.close()
            pipeline.services.stop()


def test_a_served_version_read_before_a_push_or_restart_is_not_recorded(tmp_path):
    services = Services(load_config(None, [f"output_dir={tmp_path}"]), "unused", tmp_path)
    epoch, known = services.known_served()
    assert known is None
    services.forget_served()  # a push or restart started after that reading
    services.record_served(epoch, [1])
    assert services.known_served()[1] is None
    epoch, _ = services.known_served()
    services.record_served(epoch, [2])
    assert services.known_served() == (epoch, [2])
    services.distrust()
    assert services.known_served()[1] is None


def test_a_failure_changes_the_weight_group_epoch(tmp_path):
    services = Services(load_config(None, [f"output_dir={tmp_path}"]), "unused", tmp_path)
    epoch = services.inference_epoch
    services.distrust()
    assert services.inference_epoch == epoch + 1


def test_servers_tp_sizes_come_from_their_info_and_data_parallel_ones_are_refused():
    from areal_pipeline.policy_versions import distributed_tp_sizes

    assert distributed_tp_sizes(["a:1", "b:2"], [{"tp_size": 2, "dp_size": 1}, {}]) == [2, 1]
    with pytest.raises(ValueError, match="b:2 runs with dp_size=2: SGLang takes weights over a process group only"):
        distributed_tp_sizes(["a:1", "b:2"], [{"tp_size": 1}, {"tp_size": 1, "dp_size": 2}])
