"""The trainer's weight broadcast against SGLang's own join and receive code (from its released wheels), and against
the project's server, which must join the same way."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import _sglang_reference as ref
from areal_pipeline.processes import ServerLaunchError, ServerProcess
from areal_pipeline.training.weight_sync import broadcast_weights, buckets, forget_group, rank_offsets, wire_dtype
from areal_pipeline.utils import find_free_port
from conftest import http, start_cpu_server

STANDIN = Path(__file__).resolve().parent / "_sglang_standin.py"
GROUP = "weight_update_group"


def start_standin(version: str, tp_size: int, out: Path, port: int = 0) -> ServerProcess:
    """The stand-in serving on `port` (0: a free one; where another process of the parallel tests binds that one
    between its choice and the stand-in's bind, a new one is chosen)."""
    out.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        chosen = port or find_free_port()
        server = ServerProcess([sys.executable, str(STANDIN), version, str(chosen), str(tp_size), str(out)],
                               f"127.0.0.1:{chosen}", out.parent / f"{out.name}-{chosen}.log",
                               kind="SGLang stand-in").start()
        try:
            server.wait_healthy(120)
            return server
        except ServerLaunchError as error:
            server.stop()
            if port or attempt == 2 or "Address already in use" not in str(error):
                raise


def received(out: Path, tp_rank: int) -> tuple[int, dict[str, torch.Tensor]]:
    """(update calls, every tensor received) of one TP rank."""
    calls = sorted(out.glob(f"tp{tp_rank}-call*.safetensors"), key=lambda p: int(p.stem.split("call")[1]))
    tensors: dict[str, torch.Tensor] = {}
    for path in calls:
        tensors.update(load_file(str(path)))
    return len(calls), tensors


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(16, 8, generator=g), "model.norm.weight": torch.randn(8, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g),
            "lm_head.weight": torch.randn(16, 8, generator=g)}


def test_rank_offsets_leave_room_for_every_tp_rank():
    assert rank_offsets([1, 1]) == ([1, 2], 3)
    assert rank_offsets([2, 2]) == ([1, 3], 5)  # SGLang: rank_offset + tp_rank, so server 1 starts at 1 + tp_size
    with pytest.raises(ValueError, match="positive integers"):
        rank_offsets([0])


def test_sglangs_dtype_names_map_to_a_wire_dtype():
    assert [wire_dtype(n) for n in ("half", "float", "float16", "bfloat16", "float32")] == [
        "float16", "float32", "float16", "bfloat16", "float32"]
    assert wire_dtype("auto", torch.bfloat16) == "bfloat16" and wire_dtype("auto", "float16") == "float16"
    assert wire_dtype("auto") == "float32"  # a model that names no dtype: sent whole, the server casts it
    with pytest.raises(ValueError, match="'int8' is not one of auto, half, float"):
        wire_dtype("int8")


def test_buckets_keep_the_order_and_give_a_large_tensor_a_bucket_of_its_own():
    assert list(buckets(["a", "b", "c", "d"], [4, 4, 20, 4], 8)) == [["a", "b"], ["c"], ["d"]]


@pytest.mark.parametrize("version", ref.VERSIONS)
def test_sglangs_own_join_and_receive_get_the_trainers_weights_bitwise(version, tmp_path):
    """Two servers, one with two TP ranks, joined as SGLang joins (its init_custom_process_group and receive, run
    unchanged); the update comes in buckets, the last one setting the version; a restarted server gets a new group
    (the same group would kill it, as SGLang's scheduler asserts)."""
    ref.wheel(version)
    state = state_dict()
    a, b = tmp_path / "a", tmp_path / "b"
    servers = [start_standin(version, 2, a), start_standin(version, 1, b)]
    groups: dict = {}
    try:
        def push(version_number: int, epoch: int) -> None:
            broadcast_weights(groups, state, [s.address for s in servers], version_number, "127.0.0.1",
                              find_free_port(), GROUP, "float32", "gloo", tied_embeddings=False, tp_sizes=[2, 1],
                              epoch=epoch, bucket_bytes=600)

        push(3, epoch=0)
        for out, tp_rank in ((a, 0), (a, 1), (b, 0)):
            calls, got = received(out, tp_rank)
            assert calls == 3  # 512 + 32 bytes, 384, 512 bytes: three buckets of at most 600
            assert set(got) == set(state) and all(torch.equal(got[n], state[n]) for n in state)
        requests = [json.loads(line) for line in (a / "requests.jsonl").read_text().splitlines()]
        assert [r["weight_version"] for r in requests] == [None, None, "3"]
        assert [r["flush_cache"] for r in requests] == [False, False, True]
        assert [n for r in requests for n in r["names"]] == list(state)  # the order the trainer broadcasts in

        group = groups[GROUP]
        push(4, epoch=0)  # the same servers: the same group
        assert groups[GROUP] is group and received(b, 0)[0] == 6

        servers[1].stop()  # a restarted server has no group: the next push (a new epoch) joins afresh
        for path in b.glob("tp*"):
            path.unlink()
        servers[1] = start_standin(version, 1, b, port=int(servers[1].address.rsplit(":", 1)[1]))
        state["model.norm.weight"] += 1
        push(5, epoch=1)
        calls, got = received(b, 0)
        assert calls == 3 and torch.equal(got["model.norm.weight"], state["model.norm.weight"])
        assert servers[0].popen.poll() is None and servers[1].popen.poll() is None
    finally:
        forget_group(groups, GROUP)
        for server in servers:
            server.stop()


def test_the_projects_server_joins_as_sglang_does_and_refuses_what_sglang_cannot_take(tiny_model_dir, tmp_path):
    """The project's server (a real process) joins through torch's tcp:// rendezvous, as SGLang; an update for a group
    it lacks is a clear 400 (SGLang's scheduler dies on it)."""
    from areal_pipeline.model import load_model

    server = start_cpu_server(tiny_model_dir, tmp_path)
    state = {n: t + 0.5 for n, t in load_model(tiny_model_dir).state_dict().items()}
    groups: dict = {}
    try:
        status, body = http(server.address, "/update_weights_from_distributed",
                            {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                             "group_name": GROUP})
        assert status == 400 and "Please call `init_weights_update_group` first" in body["message"]
        # a server that refuses to join ends the trainer's wait at once, with its reason (not the group's timeout)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="NCCL needs the server on a GPU"):
            broadcast_weights(groups, state, [server.address], 6, "127.0.0.1", find_free_port(), GROUP, "float32",
                              "nccl", tied_embeddings=True)
        assert time.monotonic() - started < 30 and GROUP not in groups
        broadcast_weights(groups, state, [server.address], 7, "127.0.0.1", find_free_port(), GROUP, "float32",
                          "gloo", tied_embeddings=True, bucket_bytes=1 << 16)
        assert http(server.address, "/get_model_info")[1]["weight_version"] == "7"
        status, weights = http(server.address, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 8})
        assert status == 200 and torch.equal(torch.tensor(weights), state["model.norm.weight"][:8])
    finally:
        forget_group(groups, GROUP)
        server.stop()
