import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from areal_pipeline.config import InferenceConfig, SGLangConfig
from areal_pipeline.inference.launcher import (
    build_cpu_server_command,
    build_sglang_command,
    launch_servers,
    server_processes,
)
from areal_pipeline.processes import ServerLaunchError, ServerProcess
from areal_pipeline.training.client import trainer_process
from areal_pipeline.utils import find_free_port

PY = sys.executable


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _process_tree(pid: int) -> list[int]:
    root = psutil.Process(pid)
    return [root.pid] + [p.pid for p in root.children(recursive=True)]


def test_sglang_command_defaults():
    cmd = build_sglang_command("/models/qwen", "127.0.0.1", 30000, SGLangConfig(), seed=7)
    assert cmd == [
        PY, "-m", "areal_pipeline.with_token", "--flag=--api-key",  # the run's token, never on the command line
        "-m", "sglang.launch_server",
        "--model-path", "/models/qwen",
        "--host", "127.0.0.1",
        "--port", "30000",
        "--tp-size", "1",
        "--dp-size", "1",
        "--mem-fraction-static", "0.8",
        "--dtype", "bfloat16",
        "--random-seed", "7",
        "--log-level", "warning",
        "--enable-deterministic-inference",  # else SGLang ignores the rollout's sampling_seed
    ]  # fmt: skip


def test_sglang_command_all_options():
    cfg = SGLangConfig(
        tp_size=2, dp_size=4, mem_fraction_static=0.65, context_length=8192, dtype="float16",
        disable_radix_cache=True, enable_metrics=True, log_level="info", deterministic_inference=False,
        extra_args=["--chunked-prefill-size", "4096"], python="/opt/sglang-env/bin/python",
    )  # fmt: skip
    cmd = build_sglang_command("Qwen/Qwen2.5-1.5B-Instruct", "0.0.0.0", 31001, cfg, seed=1)
    assert cmd == [
        "/opt/sglang-env/bin/python",  # SGLang's own environment
        "-m", "areal_pipeline.with_token", "--flag=--api-key", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen2.5-1.5B-Instruct",
        "--host", "0.0.0.0",
        "--port", "31001",
        "--tp-size", "2",
        "--dp-size", "4",
        "--mem-fraction-static", "0.65",
        "--dtype", "float16",
        "--random-seed", "1",
        "--log-level", "info",
        "--context-length", "8192",
        "--disable-radix-cache",
        "--enable-metrics",
        "--chunked-prefill-size", "4096",
    ]  # fmt: skip


def test_sglang_command_context_length_only():
    cmd = build_sglang_command("m", "h", 1, SGLangConfig(context_length=2048, deterministic_inference=False), seed=0)
    assert cmd[-2:] == ["--context-length", "2048"]
    assert "--disable-radix-cache" not in cmd and "--enable-metrics" not in cmd


def test_cpu_server_command():
    cfg = InferenceConfig(max_batch_size=64, context_length=512)
    assert build_cpu_server_command("/m", "127.0.0.1", 4000, cfg, seed=3) == [
        PY, "-m", "areal_pipeline.inference.server",
        "--model", "/m", "--host", "127.0.0.1", "--port", "4000",
        "--max-batch-size", "64", "--context-length", "512", "--seed", "3", "--max-body-bytes", str(64 << 20),
        "--device", "cpu", "--dtype", "float32", "--enable-deterministic-inference",
    ]  # fmt: skip
    cfg.num_threads = 2
    assert build_cpu_server_command("/m", "127.0.0.1", 4000, cfg, seed=3)[-2:] == ["--num-threads", "2"]


def _placed(*overrides: str, visible: int):
    from areal_pipeline.placement import plan
    from areal_pipeline.run_spec import load_config

    cfg = load_config(None, list(overrides))
    return cfg, plan(cfg, visible=visible)


def test_sglang_servers_each_on_their_own_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5,6,7")  # a scheduler's allocation: indices count within it
    cfg, placement = _placed("inference.backend=sglang", "inference.sglang.tp_size=2", "inference.num_servers=2",
                             "inference.sglang.mem_fraction_static=0.7", "trainer.device=cuda", "trainer.nproc=2",
                             visible=6)
    servers = server_processes("/m", cfg.inference, 1, tmp_path, list(placement.servers), bool(placement.shared))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in servers] == ["2,3", "4,5"]
    for server in servers:
        cmd = server.command
        assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--base-gpu-id") + 1] == "0"
        assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.7"
        assert server.fork is None
        assert server.env["PATH"] == os.environ["PATH"]  # the rest of the environment is passed on
    trainer = trainer_process(cfg, "/m", tmp_path, placement.trainer)
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "6,7" and trainer.fork is None and trainer.kind == "trainer"
    assert trainer.command[trainer.command.index("--nproc-per-node") + 1] == "2"


def test_one_gpu_colocated_commands(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # SGLang and the trainer on GPU 0, SGLang's share 0.4 (the trainer's 0.5 is applied by its ranks, from its config)
    cfg, placement = _placed("inference.backend=sglang", "inference.sglang.mem_fraction_static=0.4",
                             "trainer.device=cuda", "trainer.colocate=true", "trainer.memory_fraction=0.5", visible=1)
    [server] = server_processes("/m", cfg.inference, 1, tmp_path, list(placement.servers), bool(placement.shared))
    assert server.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert server.command[server.command.index("--mem-fraction-static") + 1] == "0.4"
    trainer = trainer_process(cfg, "/m", tmp_path, placement.trainer)
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "0"
    from areal_pipeline.run_spec import load_config

    saved = load_config(trainer.command[trainer.command.index("--config") + 1])
    assert saved.trainer.memory_fraction == 0.5 and saved.trainer.colocate
    # the project's own server on the GPU: --device cuda, its allocator capped at the same share
    cfg, placement = _placed("inference.device=cuda", "inference.dtype=bfloat16",
                             "inference.sglang.mem_fraction_static=0.3", "trainer.device=cuda", "trainer.colocate=true",
                             "trainer.memory_fraction=0.6", visible=1)
    [server] = server_processes("/m", cfg.inference, 1, tmp_path, list(placement.servers), bool(placement.shared))
    cmd = server.command
    assert cmd[cmd.index("--device") + 1] == "cuda" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.3"
    assert server.env["CUDA_VISIBLE_DEVICES"] == "0" and server.fork is None
    # on a GPU of its own, no cap
    cfg, placement = _placed("inference.device=cuda", "trainer.device=cpu", visible=1)
    [server] = server_processes("/m", cfg.inference, 1, tmp_path, list(placement.servers), bool(placement.shared))
    assert "--mem-fraction-static" not in server.command and server.env["CUDA_VISIBLE_DEVICES"] == "0"


def test_cpu_services_keep_their_fork_and_environment(tmp_path):
    from areal_pipeline.run_spec import load_config

    cfg = load_config(None, ["inference.dtype=bfloat16", "trainer.device=cpu"])
    [server] = server_processes("/m", cfg.inference, 1, tmp_path)
    module, argv, extra = server.fork
    assert module == "areal_pipeline.inference.server" and server.env is None
    assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--dtype") + 1] == "bfloat16"
    trainer = trainer_process(cfg, "/m", tmp_path)
    assert trainer.fork is not None and trainer.env is None
    # told to use CUDA without a placement (bench/train_throughput.py --device cuda): launched, never forked
    assert trainer_process(load_config(None, ["trainer.device=cuda"]), "/m", tmp_path).fork is None


def test_a_trainer_that_fails_to_start_is_called_the_trainer_and_says_why(tiny_model, tmp_path):
    import torch

    from areal_pipeline.run_spec import load_config
    from areal_pipeline.training.client import launch_trainer

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    # a rank on CUDA where no GPU is visible: it exits at once, naming the problem (not "invalid device ordinal")
    cfg = load_config(None, [f"output_dir={tmp_path}", "trainer.device=cuda", "trainer.setup_timeout=120"])
    with pytest.raises(ServerLaunchError, match=r"^trainer 127.0.0.1:\d+ exited with code") as error:
        launch_trainer(cfg, str(tiny_model), tmp_path)
    assert "inference server" not in str(error.value)
    assert "trainer rank 0 is to run on CUDA but sees no GPU" in str(error.value)


def test_unknown_backend_names_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="valid: cpu, sglang, vllm"):
        launch_servers("/m", InferenceConfig(backend="tensorrt-llm"), seed=1, log_dir=tmp_path)


def test_process_that_exits_at_once_reports_log_tail(tmp_path):
    script = "import sys; print('line', *range(50), sep='\\n'); sys.exit('boom: no such model')"
    server = ServerProcess([PY, "-c", script], f"127.0.0.1:{find_free_port()}", tmp_path / "s.log")
    server.start()
    with pytest.raises(ServerLaunchError) as info:
        server.wait_healthy(timeout=30)
    message = str(info.value)
    assert "exited with code 1" in message and "boom: no such model" in message
    assert "\n49\n" in message and "\n5\n" not in message  # only the tail


def test_cpu_server_with_missing_model_fails_with_log(tmp_path):
    # The server exits non-zero when its model cannot load (as SGLang does), so the launch fails fast.
    cfg = InferenceConfig(setup_timeout=120)
    with pytest.raises(ServerLaunchError) as info:
        launch_servers(str(tmp_path / "no-such-model"), cfg, seed=1, log_dir=tmp_path / "logs")
    assert "exited with code 1" in str(info.value)
    assert "no-such-model" in str(info.value).split("Last lines of")[1]
    assert (tmp_path / "logs" / "inference-server-0.log").is_file()


def test_health_timeout_stops_the_process(tmp_path):
    with ServerProcess(["sleep", "300"], f"127.0.0.1:{find_free_port()}", tmp_path / "s.log") as server:
        start = time.monotonic()
        with pytest.raises(ServerLaunchError, match="not healthy after 1s"):
            server.wait_healthy(timeout=1)
        assert time.monotonic() - start < 120  # not the 300 s the process would sleep
        assert server.popen.returncode == -signal.SIGTERM and not _alive([server.popen.pid])


def test_stop_kills_the_whole_tree(tmp_path):
    with ServerProcess(["bash", "-c", "sleep 300 & sleep 300 & wait"], "127.0.0.1:1", tmp_path / "s.log") as server:
        deadline = time.monotonic() + 10
        while len(_process_tree(server.popen.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = _process_tree(server.popen.pid)
        assert len(tree) == 3
    assert _alive(tree) == []
    server.stop()  # idempotent


def test_stop_kills_children_that_left_the_group_and_ignore_sigterm(tmp_path):
    # A child in its own session ignoring SIGTERM: only the psutil sweep + SIGKILL can get it.
    script = "trap '' TERM; setsid bash -c \"trap '' TERM; sleep 300\" & sleep 300"
    with ServerProcess(["bash", "-c", script], "127.0.0.1:1", tmp_path / "s.log") as server:
        deadline = time.monotonic() + 10
        while len({os.getsid(pid) for pid in _process_tree(server.popen.pid)}) < 2:
            assert time.monotonic() < deadline, "the setsid child never started"
            time.sleep(0.05)
        tree = _process_tree(server.popen.pid)
        start = time.monotonic()
        server.stop(timeout=1)
        assert time.monotonic() - start < 120  # not the 300 s the processes would sleep
    assert _alive(tree) == []


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from areal_pipeline.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def test_real_cpu_server_launch_and_stop(tiny_model, tmp_path):
    cfg = InferenceConfig(num_servers=1, setup_timeout=180, max_batch_size=8, context_length=256)
    [server] = launch_servers(str(tiny_model), cfg, seed=1, log_dir=tmp_path)
    try:
        assert server.is_healthy()
        assert server.address.startswith("127.0.0.1:")
        tree = _process_tree(server.popen.pid)
    finally:
        server.stop()
    assert not server.is_healthy()
    assert _alive(tree) == []


def _two_adjacent_ports_one_taken() -> tuple[int, socket.socket]:
    """A free port whose next port is taken (by the returned listening socket)."""
    deadline = time.monotonic() + 10
    while True:
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))  # the kernel's pick; the port below it must be free
        port = blocker.getsockname()[1] - 1
        probe = socket.socket()
        try:
            probe.bind(("127.0.0.1", port))
            blocker.listen()
            return port, blocker
        except OSError:
            blocker.close()
            assert time.monotonic() < deadline, "no free port below a free port on 127.0.0.1 in 10 s"
        finally:
            probe.close()


def test_one_failed_server_stops_all(tiny_model, tmp_path):
    base_port, blocker = _two_adjacent_ports_one_taken()
    cfg = InferenceConfig(num_servers=2, base_port=base_port, setup_timeout=180, context_length=256)
    try:
        with pytest.raises(ServerLaunchError, match=f"127.0.0.1:{base_port + 1} exited"):
            launch_servers(str(tiny_model), cfg, seed=1, log_dir=tmp_path)
    finally:
        blocker.close()
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(tiny_model) in (p.info["cmdline"] or []) and str(base_port) in p.info["cmdline"]]
    assert _alive([p.pid for p in leftovers]) == []


def test_set_up_steps_start_together_and_a_failure_waits_for_the_others():
    import threading

    from areal_pipeline.pipeline import run_together

    running, finished = threading.Barrier(2, timeout=10), []

    def slow_start():
        running.wait()  # only passes if the steps really run at the same time
        time.sleep(0.3)
        finished.append("slow")
        return "slow"

    def failing_start():
        running.wait()
        raise RuntimeError("could not start")

    def fast_start():
        running.wait()
        return "fast"

    assert run_together([slow_start, fast_start]) == ["slow", "fast"]
    finished.clear()
    with pytest.raises(RuntimeError, match="could not start"):
        run_together([failing_start, slow_start])
    assert finished == ["slow"]  # nothing is still starting when the caller cleans up


def test_service_ports_are_chosen_below_the_ephemeral_range():
    """A port the kernel hands out lies in the range outgoing connections draw from, where another process's
    connection can take it before the service binds it (a trainer died of EADDRINUSE under parallel tests): the
    ports chosen for services lie below it, and are free."""
    import socket

    from areal_pipeline.utils import LOWEST_CHOSEN_PORT, _ephemeral_ports, find_free_port

    low, _ = _ephemeral_ports()
    ports = [find_free_port() for _ in range(20)]
    assert all(LOWEST_CHOSEN_PORT <= p < low for p in ports), (ports, low)
    assert len(set(ports)) > 1  # drawn, not one fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))


def test_two_processes_choosing_ports_at_once_never_get_the_same_one(tmp_path):
    """Parallel test workers (or two runs) choose ports at the same moments: each port chosen is reserved for every
    other caller on the machine until its service has had time to bind it. 800 draws from 1100 ports by two
    processes would repeat ports without the reservation (a birthday collision is certain)."""
    script = ("import areal_pipeline.utils as u\n"
              "u.LOWEST_CHOSEN_PORT = 30000\n"
              "u._ephemeral_ports = lambda: (31100, 60999)\n"
              "print(' '.join(str(u.find_free_port()) for _ in range(400)))\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # a reservation folder of its own, not the session's
    pickers = [subprocess.Popen([PY, "-c", script], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    chosen = [[int(p) for p in picker.communicate(timeout=120)[0].split()] for picker in pickers]
    assert [len(ports) for ports in chosen] == [400, 400]
    everything = chosen[0] + chosen[1]
    assert all(30000 <= p < 31100 for p in everything)
    assert len(set(everything)) == len(everything), sorted(p for p in everything if everything.count(p) > 1)
