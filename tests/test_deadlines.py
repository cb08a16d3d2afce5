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
    assert time.monotonic() - started < 3 and cancelled == [True]
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
    assert time.monotonic() - started < 5
    # without a deadline the command's own timeout still applies, reported as the trainer's error
    with pytest.raises(TrainerError, match="unreachable during status"):
        TrainerClient(silent_endpoint, timeout=0.3).call("status")
