"""The one private torch name the weight-update group relies on (`_new_process_group_helper`, as SGLang calls it):
these fail when a torch release changes what `new_process_group` passes it or what it builds."""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from areal_pipeline.training.weight_group import NamedAddressTCPStore, destroy_weight_group, new_process_group


def test_the_private_helper_still_takes_what_sglang_and_this_project_pass():
    parameters = inspect.signature(c10d._new_process_group_helper).parameters
    positional = list(parameters)[:5]
    assert positional == ["group_size", "group_rank", "global_ranks_in_group", "backend", "store"]
    assert {"group_name", "backend_options", "timeout", "device_id"} <= set(parameters)
    assert isinstance(c10d._world.pg_group_ranks, dict)


def test_a_group_built_through_the_helper_broadcasts_and_its_name_can_be_used_again():
    store = NamedAddressTCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    for _ in range(2):  # destroyed, the name is free again (a restarted server's group is joined afresh)
        group = new_process_group("gloo", dist.PrefixStore("wg-test", store), 0, 1, "wg-test", timedelta(seconds=30))
        tensor = torch.arange(4.0)
        dist.broadcast(tensor, src=0, group=group)  # ranks are registered as SGLang registers them
        group.broadcast(tensor, root=0).wait()
        assert torch.equal(tensor, torch.arange(4.0)) and group.size() == 1
        destroy_weight_group(group)
    with pytest.raises(ValueError, match="unknown weight-update backend"):
        from areal_pipeline.training.weight_group import host_weight_group

        host_weight_group("mpi", "127.0.0.1", 0, 2, "x")
