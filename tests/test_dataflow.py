"""Data flows through the flow: each node of an iteration is handed the outputs of the nodes it needs
(areal_pipeline/steps.py), and the Prefect API records exactly those edges, never one to another iteration's node;
the reference and proximal logprob passes are nodes of their own where the config needs them, and change no
number."""

from __future__ import annotations

import asyncio

import torch

from test_flows import REPO, _flow_runs, _task_runs, fast_overrides, final_weights, wait_until

# KL to the reference (a ref_logprobs node) and an update of two minibatches (a proximal_logprobs node)
BOTH_PASSES = ["ppo.kl_ctl=0.05", "ppo.ppo_n_minibatches=2"]
# The server's logprobs depend on which requests share a decode batch, which timing decides on a loaded machine:
# one request a batch, so that both runs roll out the very same rows.
ONE_REQUEST_A_BATCH = ["inference.max_batch_size=1"]


def test_each_node_records_only_its_own_iterations_upstream_nodes(prefect_api, tiny_model_dir, tmp_path):
    """Three iterations in one flow run, asynchronous (iteration k+1's first nodes run during k's update, in the
    same flow run), evaluating every iteration: every task run's recorded inputs are the nodes of the same
    iteration that the step table names, and each node started after those ended, in the table's order."""
    from areal_pipeline.steps import BY_NAME, STEPS
    from flows.train import train

    train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
          overrides=fast_overrides(tmp_path, tiny_model_dir, run_id="edges", iterations=3, per_flow_run=3)
          + BOTH_PASSES + ["eval_freq=1", "rollout.max_head_offpolicyness=1"])
    (run,) = asyncio.run(_flow_runs("edges/iter-"))
    assert run.name == "edges/iter-1..3" and run.state.is_completed()

    # each iteration: rollout, ref_logprobs, advantages, proximal_logprobs, ppo_update, broadcast_weights,
    # evaluate; the last one also checkpoint
    def finished():
        found = asyncio.run(_task_runs(run.id))
        done = all(r.state is not None and r.state.is_final() for r in found)  # no state yet: not written
        return found if len(found) == 3 * 7 + 1 and done else None

    task_runs = wait_until(finished, 60, f"the task runs of {run.name}", interval=1)
    names = {r.id: r.name for r in task_runs}
    by_iteration: dict[int, dict] = {}
    for task_run in task_runs:
        node, k = task_run.name.rsplit("-", 1)
        by_iteration.setdefault(int(k), {})[node] = task_run
        assert task_run.state.is_completed(), task_run.name
        step = BY_NAME[node]
        assert set(task_run.task_inputs) == {"run", "k", *step.inputs}, task_run.name
        assert task_run.task_inputs["run"] == [] and task_run.task_inputs["k"] == [], task_run.name
        for upstream in step.inputs:
            recorded = [names.get(i.id, str(i.id)) for i in task_run.task_inputs[upstream]]
            assert recorded == [f"{upstream}-{k}"], (task_run.name, upstream, recorded)
    assert sorted(by_iteration) == [1, 2, 3]
    for k, nodes in by_iteration.items():
        expected = [s.name for s in STEPS if s.name != "checkpoint" or k == 3]
        assert sorted(nodes, key=lambda n: (nodes[n].start_time, expected.index(n))) == expected, k
        for node, task_run in nodes.items():
            for upstream in BY_NAME[node].inputs:
                assert task_run.start_time >= nodes[upstream].end_time, (node, upstream, k)
    assert_the_reference_is_the_base_model(tmp_path / "edges", tiny_model_dir, k=3)


def assert_the_reference_is_the_base_model(run_dir, base_model_dir, k: int) -> None:
    """Iteration k's ref_logprobs are the frozen base model's logprobs of its rollout, not the actor's: after k - 1
    updates the two differ, and the proximal logprobs (policy k - 1's, of the same rows) are the actor's."""
    import pyarrow.parquet as pq

    from _trainer_helpers import plain_logprobs
    from areal_pipeline.data.shards import read_table

    iteration = run_dir / f"iter_{k}"
    sequences = read_table(iteration / "rollout").column("input_ids").to_pylist()
    reference = pq.read_table(iteration / "ref_logprobs.parquet").column("logprobs").to_pylist()
    proximal = pq.read_table(iteration / "prox_logprobs.parquet").column("logprobs").to_pylist()
    base = plain_logprobs(base_model_dir, sequences)
    assert [len(r) for r in reference] == [len(s) for s in sequences] == [len(r) for r in proximal]

    def largest_difference(a, b):
        return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p[1:], q[1:]))
    assert largest_difference(reference, base) < 1e-4
    assert largest_difference(proximal, base) > 1e-3  # the actor moved: a reference taken from it would show


def test_the_logprob_nodes_give_the_weights_of_the_trainers_own_passes(prefect_api, tiny_model_dir, tmp_path):
    """The train flow with ref_logprobs and proximal_logprobs nodes ends at the very weights of the plain loop in
    which the trainer computes the proximal logprobs itself, inside the update (as before they were a node)."""
    from areal_pipeline.run_spec import resolve_run_config
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import run_lock
    from flows.train import train

    config = str(REPO / "configs/tiny_cpu.yaml")
    train(config_path=config, overrides=fast_overrides(tmp_path, tiny_model_dir, run_id="nodes", iterations=2)
          + BOTH_PASSES + ONE_REQUEST_A_BATCH)
    run_dir = tmp_path / "nodes"
    assert all((run_dir / f"iter_{k}" / name).is_file() for k in (1, 2)
               for name in ("ref_logprobs.parquet", "prox_logprobs.parquet"))

    cfg = resolve_run_config(config, fast_overrides(tmp_path, tiny_model_dir, run_id="inside", iterations=2)
                             + BOTH_PASSES + ONE_REQUEST_A_BATCH, None, None)
    pipeline = Pipeline(cfg)
    assert pipeline.proximal_columns == ("prox_logprobs",)
    pipeline.proximal_columns = ()  # no proximal_logprobs step: the trainer's update computes them
    assert "proximal_logprobs" not in pipeline.due_nodes(1) and "ref_logprobs" in pipeline.due_nodes(1)
    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            pipeline.run_iterations(1, 2)
        finally:
            pipeline.close()
            pipeline.services.stop()
    assert not (tmp_path / "inside" / "iter_1" / "prox_logprobs.parquet").exists()

    expected, got = final_weights(tmp_path / "inside", 2), final_weights(run_dir, 2)
    assert expected.keys() == got.keys() and all(torch.equal(got[n], expected[n]) for n in expected)


def test_proximal_logprobs_that_do_not_fit_the_batch_are_refused(tmp_path):
    """The trainer trains on a proximal_logprobs file only where it holds a value per token of every sequence;
    otherwise (or where it is no Parquet file) IntegrityError, which the trainer answers as a corrupt file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    from areal_pipeline.checksums import IntegrityError
    from areal_pipeline.training.batches import read_logprobs

    path = tmp_path / "prox_logprobs.parquet"
    pq.write_table(pa.table({"logprobs": pa.array([[-0.5, -1.25, 0.0], [-2.0, -0.125]], pa.list_(pa.float32()))}),
                   path)
    assert read_logprobs(path, [[1, 2, 3], [4, 5]]) == [[-0.5, -1.25, 0.0], [-2.0, -0.125]]
    with pytest.raises(IntegrityError, match="do not match the 2 sequences"):
        read_logprobs(path, [[1, 2, 3], [4, 5, 6]])
    with pytest.raises(IntegrityError, match="do not match the 3 sequences"):
        read_logprobs(path, [[1, 2, 3], [4, 5], [6]])
    path.write_bytes(b"not parquet")
    with pytest.raises(IntegrityError, match="unreadable logprobs"):
        read_logprobs(path, [[1, 2, 3], [4, 5]])
