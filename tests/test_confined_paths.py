"""Issue #48: a path in a request resolves, symlinks followed, inside the run's directories, or nothing is read or
written there (a 403 naming it); the weight-update group is joined only with the trainer, one at a time. Against a
real trainer (torchrun) and a real CPU server, as the pipeline drives them."""

from __future__ import annotations

import inspect
import os
import shutil
import threading

import pytest

from areal_pipeline.confined_paths import OutsideRoots, confine, resolve_roots, run_roots
from areal_pipeline.inference.launcher import build_cpu_server_command
from areal_pipeline.inference.server_args import build_arg_parser
from areal_pipeline.run_spec import load_config
from areal_pipeline.training.client import TrainerError, launch_trainer
from areal_pipeline.training.trainer_server import PATH_ARGUMENTS, Trainer
from areal_pipeline.training.weight_group import destroy_weight_group, host_weight_group
from areal_pipeline.utils import find_free_port
from conftest import http, start_cpu_server

GROUP = "weight_update_group"


# ----- the rule ---------------------------------------------------------------------------------------------------

def test_a_path_counts_where_it_resolves(tmp_path):
    root, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    (root / "r").mkdir(parents=True)
    elsewhere.mkdir()
    (root / "r" / "out").symlink_to(elsewhere)
    (tmp_path / "linked-root").symlink_to(root)
    roots = resolve_roots([tmp_path / "linked-root"])  # a root that is a link counts where it points
    assert roots == [root.resolve()]
    assert confine(root / "r" / "ckpt" / "not-yet", roots) == (root / "r" / "ckpt" / "not-yet").resolve()
    assert confine(tmp_path / "linked-root" / "r", roots) == (root / "r").resolve()
    for outside in (elsewhere / "x", root / "r" / "out" / "x", root / "r" / ".." / ".." / "elsewhere" / "x",
                    root.parent, "relative/elsewhere", "a\0b"):
        with pytest.raises(OutsideRoots, match="is outside the allowed directories"):
            confine(outside, roots, "save's 'path'")
    with pytest.raises(OutsideRoots, match="it resolves to .*elsewhere/x"):
        confine(root / "r" / "out" / "x", roots)
    assert confine(root, roots) == root.resolve()  # a read of the root itself is fine; a write over it is not
    with pytest.raises(OutsideRoots, match="must lie below"):
        confine(root, roots, allow_root=False)
    with pytest.raises(OutsideRoots, match="none was configured"):
        confine(root / "r", [])
    assert run_roots("runs", "") == [os.path.abspath("runs")]


def test_a_root_that_resolves_nowhere_is_dropped_and_a_root_given_twice_counts_once(tmp_path):
    """A root in a symlink loop (or with a NUL byte) allows nothing, and leaves the others working (found by mutation
    testing: `and` for `or` kept such a root as None, and every later check raised TypeError instead of refusing)."""
    root = tmp_path / "runs"
    root.mkdir()
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    roots = resolve_roots([tmp_path / "loop", "a\0b", root, tmp_path / "runs" / ".", ""])
    assert roots == [root.resolve()]
    assert confine(root / "x", roots) == (root / "x").resolve()
    with pytest.raises(OutsideRoots, match="is outside the allowed directories"):
        confine(tmp_path / "elsewhere", roots)


def test_every_path_argument_of_a_trainer_command_is_checked():
    """A handler's parameter that names a file or directory is in PATH_ARGUMENTS (else a new one would go
    unchecked)."""
    handlers = Trainer.handlers(Trainer.__new__(Trainer))
    named = {(cmd, p) for cmd, handler in handlers.items() for p in inspect.signature(handler).parameters
             if p == "path" or p.endswith(("_dir", "_path")) or p == "policy_logprobs"}
    assert named == {(cmd, p) for cmd, args in PATH_ARGUMENTS.items() for p in args}


def test_the_launcher_gives_a_run_s_server_its_roots_and_trainer(tmp_path):
    model = tmp_path / "base"
    model.mkdir()
    cfg = load_config(None, [f"output_dir={tmp_path / 'runs'}", f"trainer.weights_dir={tmp_path / 'w'}",
                             f"model.path={model}"])
    cmd = build_cpu_server_command("/m", "127.0.0.1", 4000, cfg.inference, 3, experiment=cfg)
    args = build_arg_parser().parse_args(cmd[3:])
    assert args.weights_root == [str(tmp_path / "runs"), str(tmp_path / "w"), str(model)]
    assert args.weight_group_master == ["127.0.0.1"]  # the launched trainer's (policy_versions.py)
    shared = [f"output_dir={tmp_path / 'runs'}", f"trainer.weights_dir={tmp_path / 'w'}"]
    for trainer, masters in (("trainer.address=10.0.0.5:7000", ["10.0.0.5"]), ("trainer.address=auto", [])):
        cfg = load_config(None, [*shared, trainer, "trainer.port=7000"])
        cmd = build_cpu_server_command("/m", "h", 1, cfg.inference, 3, experiment=cfg)
        assert build_arg_parser().parse_args(cmd[3:]).weight_group_master == masters
    cfg = load_config(None, [*shared, "trainer.weight_sync_master_address=10.1.1.1", "trainer.address=auto"])
    cmd = build_cpu_server_command("/m", "h", 1, cfg.inference, 3, experiment=cfg)
    assert build_arg_parser().parse_args(cmd[3:]).weight_group_master == ["10.1.1.1"]
    # a server of no run (the served judge) is given neither
    assert "--weights-root" not in build_cpu_server_command("/m", "h", 1, cfg.inference, 3)


# ----- the trainer ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("confined-trainer")
    cfg = load_config(None, [f"output_dir={base / 'runs'}", "run_id=r", "total_iterations=2",
                             "trainer.num_threads=1"])
    (base / "runs" / "r").mkdir(parents=True)
    process, client = launch_trainer(cfg, str(tiny_model_dir), base / "runs" / "r" / "logs")
    yield base, client
    process.stop()


def refused(client, cmd: str, argument: str, **args) -> TrainerError:
    with pytest.raises(TrainerError) as raised:
        client.call(cmd, **args)
    error = raised.value
    assert (error.status, error.code, error.details["argument"]) == (403, "forbidden_path", argument), str(error)
    assert str(args[argument]) in str(error) and "is outside the allowed directories" in str(error)
    return error


def test_the_trainer_refuses_paths_outside_the_run_and_writes_nothing(trainer):
    base, client = trainer
    run_dir, elsewhere = base / "runs" / "r", base / "elsewhere"
    elsewhere.mkdir()
    (run_dir / "out").symlink_to(elsewhere)  # inside the run's directory, pointing out of it
    batch = elsewhere / "batch"
    batch.mkdir()
    (batch / "manifest.json").write_text("{}")
    error = refused(client, "save", "path", path=str(elsewhere / "ckpt"))
    assert error.details["roots"] == [str((base / "runs").resolve())]
    refused(client, "save_weights", "path", path=str(run_dir / "out" / "v1"))
    refused(client, "save_weights", "path", path=str(run_dir / ".." / ".." / "elsewhere" / "v2"))
    refused(client, "save", "path", path=str(base / "runs"))  # never over a whole root
    refused(client, "compute_logp", "out_path", shard_dir=str(run_dir), out_path=str(run_dir / "out" / "lp.parquet"))
    refused(client, "compute_logp", "shard_dir", shard_dir=str(batch), out_path=str(run_dir / "lp.parquet"))
    refused(client, "train", "batch_dir", batch_dir=str(batch), iteration=1)
    refused(client, "train", "policy_logprobs", batch_dir=str(run_dir), iteration=1,
            policy_logprobs=str(run_dir / "out" / "lp.parquet"))
    refused(client, "load", "path", path=str(run_dir / "out"))
    assert sorted(p.name for p in elsewhere.iterdir()) == ["batch"]  # nothing written
    assert not (run_dir / "lp.parquet").exists()
    assert client.call("status")["version"] == 0  # nothing trained or loaded
    # the pipeline's own paths (absolute, or relative to the trainer's directory as the run's config gives them)
    assert client.call("save", path=str(run_dir / "checkpoints" / "iter_0"))["version"] == 0
    relative = os.path.relpath(run_dir / "checkpoints" / "iter_0")
    assert client.call("load", path=relative)["version"] == 0
    client.call("save_weights", path=str(run_dir / "weights" / "v0"))
    assert (run_dir / "weights" / "v0" / "config.json").is_file()


# ----- the inference server ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def roots(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("confined-server")
    root, elsewhere = base / "runs", base / "elsewhere"
    shutil.copytree(tiny_model_dir, root / "r" / "weights" / "v1")
    shutil.copytree(tiny_model_dir, elsewhere / "v1")
    (root / "r" / "out").symlink_to(elsewhere)
    (root / "r" / "mixed").mkdir()
    for file in (root / "r" / "weights" / "v1").iterdir():  # a directory inside whose weights are linked out
        (root / "r" / "mixed" / file.name).symlink_to(elsewhere / "v1" / file.name)
    server = start_cpu_server(tiny_model_dir, base / "logs", "--weights-root", str(root),
                              "--weight-group-master", "127.0.0.1", "--weight-group-master", "localhost")
    yield root, elsewhere, server.address
    server.stop()


def weight_version(address: str) -> str:
    status, info = http(address, "/model_info")
    assert status == 200, info
    return info["weight_version"]


def test_the_server_loads_only_inside_its_roots(roots):
    root, elsewhere, address = roots
    before = weight_version(address)
    for path in (elsewhere / "v1", root / "r" / "out" / "v1", root / "r" / "mixed", root / ".." / "elsewhere" / "v1"):
        status, reply = http(address, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "9"})
        assert status == 403 and reply["success"] is False, reply
        assert "refused to load weights" in reply["message"] and "--weights-root" in reply["message"], reply
        assert str(path) in reply["message"]
        assert weight_version(address) == before  # nothing loaded
    status, reply = http(address, "/update_weights_from_disk",
                         {"model_path": str(root / "r" / "weights" / "v1"), "weight_version": "1"})
    assert status == 200 and reply["success"] and weight_version(address) == "1", reply


def test_a_server_without_roots_loads_nothing_from_disk(tiny_model_dir, tmp_path):
    server = start_cpu_server(tiny_model_dir, tmp_path, session_root=False)
    try:
        before = weight_version(server.address)
        status, reply = http(server.address, "/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
        assert status == 403 and reply["success"] is False and "--weights-root DIR" in reply["message"], reply
        assert str(tiny_model_dir) in reply["message"] and weight_version(server.address) == before
    finally:
        server.stop()


def join(address: str, master: str = "127.0.0.1", group: str = GROUP, port: int = 0):
    return http(address, "/init_weights_update_group",
                {"master_address": master, "master_port": port or find_free_port(), "rank_offset": 1,
                 "world_size": 2, "backend": "gloo", "group_name": group}, timeout=120)


def hosted_join(address: str):
    """This process as the trainer (rank 0) of a group the server joins; (its group, the server's reply)."""
    port, hosted = find_free_port(), {}
    host = threading.Thread(target=lambda: hosted.update(
        zip(("group", "store"), host_weight_group("gloo", "127.0.0.1", port, 2, GROUP))))
    host.start()
    status, reply = join(address, port=port)
    host.join(120)
    assert status == 200 and "group" in hosted, reply
    return hosted["group"]


def test_the_server_joins_one_group_and_only_its_trainer_s(roots):
    *_, address = roots
    status, reply = join(address, master="127.0.0.2")  # a loopback address, but not the trainer's
    assert status == 403 and "--weight-group-master" in reply["message"] and "127.0.0.2" in reply["message"], reply
    group = hosted_join(address)
    try:
        for master, name in (("127.0.0.1", "another_group"), ("localhost", GROUP)):
            status, reply = join(address, master=master, group=name)
            assert status == 409 and "already in weight-update group" in reply["message"], reply
            assert name in reply["message"] and "destroy_weights_update_group" in reply["message"]
    finally:
        assert http(address, "/destroy_weights_update_group", {"group_name": GROUP})[0] == 200
        destroy_weight_group(group)
    # left, it joins again: the pipeline destroys its group before every join (weight_sync.py)
    group = hosted_join(address)
    assert http(address, "/destroy_weights_update_group", {"group_name": GROUP})[0] == 200
    destroy_weight_group(group)
