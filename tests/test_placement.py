"""GPU placement (areal_pipeline/placement.py): which GPUs the inference servers and the trainer ranks get, and the
CUDA_VISIBLE_DEVICES each process is started with. No GPU is needed: the machine's GPU count is a parameter."""

from __future__ import annotations

import pytest

from areal_pipeline import placement as placement_module
from areal_pipeline.config import ConfigError
from areal_pipeline.placement import PlacementError, gpu_env, plan, rank_cuda_index
from areal_pipeline.run_spec import load_config


def cfg(*overrides: str):
    return load_config(None, list(overrides))


SGLANG_TP2_X2 = ("inference.backend=sglang", "inference.sglang.tp_size=2", "inference.num_servers=2")


def test_automatic_placement_is_disjoint_servers_first():
    p = plan(cfg(*SGLANG_TP2_X2, "trainer.nproc=4", "trainer.device=cuda"), visible=8)
    assert p.servers == ((0, 1), (2, 3)) and p.trainer == (4, 5, 6, 7) and p.shared == ()


def test_automatic_placement_that_does_not_fit_names_the_ways_out():
    with pytest.raises(PlacementError, match=r"trainer needs 4 GPU\(s\) and 0 of the 4 GPU\(s\) visible.*"
                                             r"trainer.colocate=true.*trainer.gpus"):
        plan(cfg(*SGLANG_TP2_X2, "trainer.nproc=4", "trainer.device=cuda"), visible=4)


def test_one_gpu_colocated():
    one_gpu = cfg("inference.backend=sglang", "trainer.device=cuda", "trainer.colocate=true",
                  "inference.sglang.mem_fraction_static=0.4", "trainer.memory_fraction=0.5")
    p = plan(one_gpu, visible=1)
    assert p.servers == ((0,),) and p.trainer == (0,) and p.shared == (0,)
    # the project's own server on the GPU, likewise
    p = plan(cfg("inference.device=cuda", "trainer.device=cuda", "trainer.colocate=true",
                 "inference.sglang.mem_fraction_static=0.3", "trainer.memory_fraction=0.6"), visible=1)
    assert p.servers == ((0,),) and p.trainer == (0,)


def test_explicit_and_partly_explicit_lists():
    p = plan(cfg("inference.backend=sglang", "inference.gpus=[3]", "trainer.nproc=3", "trainer.gpus=[0,1,2]",
                 "trainer.device=cuda"), visible=4)
    assert p.servers == ((3,),) and p.trainer == (0, 1, 2)
    # an automatic list takes what the explicit one leaves
    p = plan(cfg("inference.backend=sglang", "trainer.nproc=2", "trainer.gpus=[0,1]", "trainer.device=cuda"), visible=4)
    assert p.servers == ((2,),) and p.trainer == (0, 1)
    p = plan(cfg("inference.backend=sglang", "inference.gpus=[0]", "trainer.nproc=2", "trainer.device=cuda"), visible=4)
    assert p.trainer == (1, 2)


def test_gpus_beyond_the_machine_are_refused():
    with pytest.raises(PlacementError, match=r"GPU\(s\) \[5\] are placed.*2 GPU\(s\) visible"):
        plan(cfg("inference.backend=sglang", "inference.gpus=[5]", "trainer.device=cpu"), visible=2)


def test_nccl_ranks_need_a_gpu_each_when_the_trainer_is_automatic():
    # trainer.device=auto becomes cuda on a GPU machine: 2 ranks, 1 GPU left after the server
    with pytest.raises(PlacementError, match="trainer needs 2 GPU"):
        plan(cfg("inference.backend=sglang", "trainer.nproc=2"), visible=2)


def test_a_cpu_run_never_asks_for_gpus(monkeypatch):
    def no_gpu_question():
        raise AssertionError("a CPU run asked how many GPUs the machine has")

    monkeypatch.setattr(placement_module, "visible_gpu_count", no_gpu_question)
    p = plan(cfg("trainer.device=cpu", "inference.num_servers=2"))
    assert p.servers == ((), ()) and p.trainer == ()
    p = plan(cfg("trainer.device=cpu", "inference.addresses=[127.0.0.1:1]"))
    assert p.servers == () and p.trainer == ()


def test_automatic_trainer_device_on_a_machine_without_gpus():
    assert plan(cfg(), visible=0) == placement_module.Placement(servers=((),), trainer=())


def test_cuda_visible_devices_are_named_within_the_parents():
    assert gpu_env((1, 3), {})["CUDA_VISIBLE_DEVICES"] == "1,3"
    env = gpu_env((1, 3), {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "PATH": "/bin"})
    assert env == {"CUDA_VISIBLE_DEVICES": "5,7", "PATH": "/bin"}
    assert gpu_env((0,), {"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"})["CUDA_VISIBLE_DEVICES"] == "GPU-aa"
    with pytest.raises(PlacementError, match="CUDA_VISIBLE_DEVICES=4,5 names 2"):
        gpu_env((2,), {"CUDA_VISIBLE_DEVICES": "4,5"})


def test_rank_to_device():
    assert [rank_cuda_index(r, 2, "nccl") for r in range(2)] == [0, 1]
    # the bench's two ranks on a one-GPU machine: a clear refusal, not "invalid device ordinal"
    with pytest.raises(PlacementError, match="rank 1 has no GPU of its own.*trainer.nproc to at most 1"):
        rank_cuda_index(1, 1, "nccl")
    assert [rank_cuda_index(r, 1, "gloo") for r in range(3)] == [0, 0, 0]
    with pytest.raises(PlacementError, match="sees no GPU.*trainer.device=cpu"):
        rank_cuda_index(0, 0, "nccl")


def test_trainer_rank_on_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    import torch

    from areal_pipeline.training.engine import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(PlacementError, match="trainer rank 1 is to run on CUDA but sees no GPU"):
        resolve_device("cuda", "nccl")
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("overrides, message", [
    (("trainer.device=cuda", "trainer.nproc=2", "trainer.gpus=[0]"),
     r"trainer.gpus=\[0\]: must name trainer.nproc=2 GPU\(s\), one per rank: NCCL never puts two ranks on one GPU"),
    (("inference.backend=sglang", "inference.gpus=[0]", "trainer.device=cuda", "trainer.gpus=[0]"),
     r"share GPU\(s\) \[0\]: set trainer.colocate=true"),
    (("inference.backend=sglang", "inference.gpus=[0]", "trainer.device=cuda", "trainer.gpus=[0]",
      "trainer.colocate=true"), r"trainer.memory_fraction=1.0: .*their sum must be below 1"),
    (("inference.gpus=[0]",), "must be empty while the servers run on the CPU"),
    ((*SGLANG_TP2_X2, "inference.gpus=[0,1,2]"), r"must name 4 GPU\(s\): 2 server\(s\) x 2 \(tp_size x dp_size\)"),
    (("inference.device=cuda", "inference.num_servers=2", "inference.gpus=[0]"), r"must name 2 GPU\(s\)"),
    (("trainer.device=cpu", "trainer.gpus=[0]"), "trainer.gpus=.0.: must be empty with trainer.device=cpu"),
    (("inference.gpus=[1,1]",), "inference.gpus=.1, 1.: must be a list of distinct GPU indices"),
    (("inference.device=tpu",), "inference.device='tpu': must be one of cpu, cuda"),
    (("inference.dtype=int8",), "inference.dtype='int8': must be one of float32"),
    (("trainer.memory_fraction=0",), r"trainer.memory_fraction=0.0: must be in \(0, 1\]"),
    (("inference.addresses=[localhost]",), "must be a list of distinct host:port addresses"),
    (("inference.addresses=[127.0.0.1:1]", "inference.gpus=[0]"), "must be empty with inference.addresses set"),
    (("inference.addresses=[127.0.0.1:1,127.0.0.1:2]", "inference.num_servers=3"),
     r"inference.num_servers=3: must be the number of inference.addresses \(2\)"),
    (("inference.addresses=[10.1.2.3:30000]",), "trainer.weights_dir='': servers on other hosts"),
    (("inference.addresses=[10.1.2.3:30000]", "trainer.weight_sync=distributed"),
     r"trainer.weight_sync_master_address='' \(the launched trainer's address, 127.0.0.1\): servers on other "
     r"hosts .10.1.2.3:30000. cannot reach it"),
    (("trainer.nnodes=2",), "trainer.nnodes=2: a trainer of several nodes runs on them.*set trainer.address=auto"),
    (("trainer.nnodes=2", "trainer.address=auto", "output_dir=/shared/runs"),
     "trainer.rdzv_endpoint='': 2 trainer nodes meet at a rendezvous every node reaches"),
    (("trainer.nnodes=2", "trainer.address=auto", "trainer.rdzv_endpoint=localhost:29400", "output_dir=/shared"),
     "trainer.rdzv_endpoint='localhost:29400'"),
    (("trainer.address=auto",), "output_dir='runs': the trainer's nodes read the run's shards"),
    (("trainer.address=10.0.0.3:8000", "output_dir=/shared"),
     "trainer.port=0: the trainer's nodes serve rank 0's endpoint on it.*set it to 8000"),
    (("trainer.address=10.0.0.3:8000", "trainer.port=8000", "output_dir=/shared",
      "trainer.weight_sync_master_address=127.0.0.1"),
     "trainer.weight_sync_master_address='127.0.0.1': the trainer runs on other hosts"),
    (("trainer.address=auto", "output_dir=/shared", "trainer.weight_sync=distributed"),
     "inference.host='127.0.0.1': the trainer on other hosts sends weights to the servers this run launches"),
    (("trainer.address=auto", "output_dir=/shared", "trainer.weights_dir=weights"),
     "trainer.weights_dir='weights': servers on other hosts .the trainer's. load each version"),
    (("trainer.address=trainer-a", "output_dir=/shared"), "trainer.address='trainer-a': must be empty, auto or host:port"),
    (("inference.backend=sglang", "trainer.device=cpu", "trainer.weight_sync=distributed"),
     "SGLang servers receive weights over NCCL.*use trainer.weight_sync=disk"),
])
def test_placement_config_is_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        cfg(*overrides)


def test_placement_configs_that_load():
    cfg("inference.backend=sglang", "inference.gpus=[0]", "trainer.device=cuda", "trainer.gpus=[0]",
        "trainer.colocate=true", "inference.sglang.mem_fraction_static=0.4", "trainer.memory_fraction=0.5")
    cfg(*SGLANG_TP2_X2, "inference.gpus=[0,1,2,3]", "trainer.device=cuda", "trainer.nproc=4", "trainer.gpus=[4,5,6,7]")
    # gloo ranks may share GPUs
    cfg("trainer.device=cuda", "trainer.backend=gloo", "trainer.nproc=2", "trainer.gpus=[0]")
    cfg("inference.addresses=[10.1.2.3:30000]", "trainer.weights_dir=/shared/weights")
    cfg("inference.addresses=[10.1.2.3:30000]", "output_dir=/shared/runs")
    # across hosts: two trainer nodes found by their announcement, servers on a third, weights by process group
    cfg("trainer.nnodes=2", "trainer.address=auto", "trainer.rdzv_endpoint=train-a:29400", "output_dir=/shared/runs",
        "inference.addresses=[gen:30000]", "trainer.weight_sync=distributed")
    cfg("inference.addresses=[10.1.2.3:30000]", "trainer.weight_sync=distributed",
        "trainer.weight_sync_master_address=10.1.2.1")
    # a CUDA trainer and the project's CPU server: distributed sync runs over gloo from host copies
    cfg("trainer.device=cuda", "trainer.weight_sync=distributed")


def test_weight_update_group_is_nccl_only_between_distinct_gpus():
    """NCCL refuses two members on one GPU ("Duplicate GPU detected": one-GPU colocated use): such groups are gloo."""
    from areal_pipeline.training.weight_sync import weight_group_backend

    assert weight_group_backend("GPU-a", ["cuda", "cuda"], ["GPU-b", "GPU-c"], colocated=False) == "nccl"
    assert weight_group_backend("GPU-a", None, None, colocated=False) == "nccl"  # SGLang says neither
    assert weight_group_backend("GPU-a", ["cuda"], ["GPU-a"], colocated=False) == "gloo"  # an external server on it
    assert weight_group_backend("GPU-a", ["cuda"], [None], colocated=True) == "gloo"  # SGLang colocated
    assert weight_group_backend("GPU-a", ["cuda", "cpu"], ["GPU-b", None], colocated=False) == "gloo"
    assert weight_group_backend(None, ["cuda"], ["GPU-b"], colocated=False) == "gloo"  # a CPU trainer
