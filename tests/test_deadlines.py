"""Node deadlines: blocking calls inside `deadline(...)` end at the limit, whatever they are blocked on."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from areal_pipeline.training.client import TrainerClient, TrainerError
from areal_pipeline.utils import DeadlineExceeded, deadline, run_async, time_left


def test_time_left_without_a_deadline_is_the_call_s_own_limit():
    assert time_left(5.0) == 5.0 and time_left() is None
    with deadline(100, "outer"):
        assert 99 < time_left() <= 100 and time_left(3.0) == 3.0
        with deadline(1, "inner"):
            assert time_left(3.0) <= 1
        assert time_left() > 99  # the outer deadline again
    with deadline(None, "unbounded"):
        assert time_left() is None


def test_async_work_is_cancelled_at_the_deadline():
    cancelled = []

    async def stuck():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    started = time.monotonic()
    with deadline(0.3, "rollout of iteration 3"), pytest.raises(DeadlineExceeded,
                                                                match="rollout of iteration 3 ran past its 0.3 s"):
        run_async(stuck())
    assert time.monotonic() - started < 20 and cancelled == [True]  # not the 30 s sleep it cancelled
    with pytest.raises(DeadlineExceeded):  # once past, the next blocking call fails at once
        with deadline(0.01, "late"):
            time.sleep(0.02)
            time_left()
    never_started = stuck()
    with pytest.raises(DeadlineExceeded), deadline(0.01, "late"):
        time.sleep(0.02)
        run_async(never_started)
    assert never_started.cr_frame is None  # closed, not left to warn that it was never awaited


def test_a_timeout_of_the_work_itself_is_not_reported_as_the_deadline():
    with deadline(30, "evaluate"), pytest.raises(TimeoutError) as raised:
        run_async(asyncio.wait_for(asyncio.sleep(5), 0.05))
    assert not isinstance(raised.value, DeadlineExceeded)


@pytest.fixture
def silent_endpoint():
    """A loopback TCP server that accepts connections and never answers (a hung trainer)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


def test_a_hung_trainer_command_ends_at_the_deadline(silent_endpoint):
    client = TrainerClient(silent_endpoint, timeout=3600)
    started = time.monotonic()
    with deadline(0.5, "ppo_update of iteration 7"), pytest.raises(DeadlineExceeded, match="ppo_update of iteration 7"):
        client.call("train", batch_dir="x", iteration=7)
    assert time.monotonic() - started < 60  # not the client's hour
    # without a deadline the command's own timeout still applies, reported as the trainer's error
    with pytest.raises(TrainerError, match="unreachable during status"):
        TrainerClient(silent_endpoint, timeout=0.3).call("status")


def test_a_server_paused_and_never_resumed_fails_the_request_naming_it(tmp_path):
    """The orchestrator paused the servers for an update and never resumed them (hung or gone): the rollout's
    requests wait `inference.pause_timeout`, then fail naming the server, instead of spinning for good."""
    from areal_pipeline.config import InferenceConfig
    from areal_pipeline.inference.client import RemoteSGLangEngine
    from areal_pipeline.inference.launcher import launch_servers
    from areal_pipeline.inference.types import ModelRequest, SamplingParams
    from areal_pipeline.model import build_tiny_model
    from areal_pipeline.utils import PeerTimeout

    model = build_tiny_model(tmp_path / "tiny")
    [server] = launch_servers(str(model), InferenceConfig(num_servers=1, num_threads=1, setup_timeout=180), seed=1,
                              log_dir=tmp_path)
    try:
        async def main():
            async with RemoteSGLangEngine([server.address], pause_timeout=1.5) as engine:
                req = ModelRequest(input_ids=[10, 20, 30], sampling=SamplingParams(max_new_tokens=4))
                assert len((await engine.agenerate(req)).output_tokens) == 4  # served while not paused
                await engine.pause()
                started = time.monotonic()
                with pytest.raises(PeerTimeout, match=f"server {server.address}: no resume from the orchestrator "
                                                      "after a pause within 1.5 s"):
                    await engine.agenerate(req)
                return time.monotonic() - started

        assert 1.5 <= asyncio.run(main()) < 60  # it does not spin for good
    finally:
        server.stop()
    with pytest.raises(ValueError, match="pause_timeout must be positive"):
        RemoteSGLangEngine(["127.0.0.1:1"], pause_timeout=0)


def test_a_stopped_trainer_rank_fails_the_command_at_the_collective_timeout_naming_it(tmp_path):
    """SIGSTOP on rank 1 of two: rank 0 waits `trainer.collective_timeout` for it, not the control group's idle
    limit, answers naming it, and the trainer ends (its ranks are out of step for good)."""
    import os
    import signal
    import sys

    import psutil

    sys.path.insert(0, os.path.dirname(__file__))
    from _trainer_helpers import trainer_config
    from areal_pipeline.model import build_tiny_model
    from areal_pipeline.training.client import launch_trainer

    cfg = trainer_config(tmp_path, "trainer.nproc=2", "trainer.collective_timeout=3", "trainer.command_timeout=120")
    process, client = launch_trainer(cfg, str(build_tiny_model(tmp_path / "tiny")), tmp_path / "logs")
    try:
        [rank1] = [p for p in psutil.Process().children(recursive=True)
                   if "trainer_server" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1"]
        rank1.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TrainerError, match=r"trainer rank\(s\) 1 \(one or more\): no receipt of command "
                                               r"'save_weights' within 3 s") as raised:
            client.call("save_weights", path=str(tmp_path / "w"))
        assert raised.value.code == "peer_timeout" and time.monotonic() - started < 90  # not the 120 s command timeout
        rank1.send_signal(signal.SIGCONT)
        assert "the trainer stops" in (tmp_path / "logs" / "trainer.log").read_text()
    finally:
        process.stop()


RANK_JOINING = """
import datetime, sys, time
import torch, torch.distributed as dist
from areal_pipeline.training.trainer_server import join_process_group
rank, delay, store = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(delay)
join_process_group("gloo", f"file://{store}?rank={rank}&world_size=2", datetime.timedelta(seconds=2),
                   datetime.timedelta(seconds=120))
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print("sum", total.item(), flush=True)
dist.destroy_process_group()
"""


def test_ranks_that_start_further_apart_than_the_collective_timeout_still_form_the_group(tmp_path):
    """trainer.collective_timeout bounds the collectives, not the ranks' start: gloo's connection of the ranks waits
    only the group's timeout, so the ranks first meet on the rendezvous store (within trainer.setup_timeout). Rank 1
    starts 6 s after rank 0, three times the 2 s collective timeout."""
    import subprocess
    import sys

    store = tmp_path / "store"
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_JOINING, str(rank), str(delay), str(store)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, delay in ((0, 0.0), (1, 6.0))]
    try:
        outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert all("sum 3.0" in out for out in outputs), outputs
