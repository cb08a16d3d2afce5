"""Rollout throughput: output tokens/s of 64 concurrent episodes through the CPU inference server, against
`model.generate` on the same padded batch and against one request at a time through the server.

    python bench/rollout_throughput.py [--episodes 64] [--prompt-len 20] [--new-tokens 64] [--repeats 5] [--threads 1]
    python bench/rollout_throughput.py --device cuda --dtype bfloat16 --shape qwen2.5-0.5b --new-tokens 256   (on a GPU)

Targets (issue 2): server within 10% of batched generate (ratio >= 0.9) and >= 4x one-at-a-time.
Each side runs as it would in use: the server as the pipeline launches it (`ServerProcess`: OpenMP threads wait
passively), `model.generate` in a process of its own. Not in this process: OpenMP threads of a process that has
just generated keep spinning, and they took half the cores from the server measured next
(server_vs_batched_generate 0.49-0.57 on 2 cores, against 1.0 with this process's threads passive). Both use
`--threads` torch threads (default 1, as the default config's `inference.num_threads`): with 2 threads on 2 cores
and any other process busy, every parallel region waits for a descheduled thread, and the same `generate` took
0.28 s or 17 s from one run to the next.
On a GPU (`--device cuda`) both sides run there in `--dtype`, on a model of `--shape` built from a config (random
weights, nothing downloaded), and generate's time ends at a device synchronisation.
Each measurement lasts about half a second, and this machine's speed moves between seconds: the ratios are
taken within each repeat (server and generate back to back) and their median reported, with their range.
With `--vllm` (vLLM's interpreter, or "auto": inference.vllm.python's default), a vLLM server on the same model, in
the same dtype, takes the same concurrent requests through the pipeline's vLLM client, in each repeat beside the
project's server: `vllm_tokens_per_s` and `vllm_vs_server` (their ratio within each repeat, then the median).
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.inference.launcher import build_vllm_command, vllm_env
from areal_pipeline.inference.types import ModelRequest, SamplingParams
from areal_pipeline.processes import ServerProcess
from areal_pipeline.model import load_model
from areal_pipeline.utils import find_free_port
from train_throughput import SHAPES, build_model  # bench/ is this script's directory, first on sys.path


async def through_server(engine: RemoteSGLangEngine, prompts, new_tokens: int, concurrent: bool) -> float:
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)

    async def one(p):
        resp = await engine.agenerate(ModelRequest(input_ids=p, sampling=sampling))
        return resp.output_len

    start = time.perf_counter()
    if concurrent:
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    else:
        tokens = 0
        for p in prompts:
            tokens += await one(p)
    return tokens / (time.perf_counter() - start)


def batched_generate(model, prompts, new_tokens: int, pad_id: int) -> float:
    ids = torch.tensor(prompts, device=model.device)  # equal lengths: the padded batch needs no padding
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id)
    if out.is_cuda:
        torch.cuda.synchronize()
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - start)


def generate_in_own_process(model_dir: str, prompts, new_tokens: int, threads: int, device: str,
                             dtype: str) -> float:
    """`batched_generate` (after a warm-up) in a fresh process: its tokens/s."""
    done = subprocess.run([sys.executable, __file__, "--generate-worker", model_dir, "--new-tokens", str(new_tokens),
                           "--threads", str(threads), "--device", device, "--dtype", dtype],
                          input=json.dumps(prompts), capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def generate_worker(model_dir: str, new_tokens: int, threads: int, device: str, dtype: str) -> None:
    torch.set_num_threads(threads)
    prompts = json.loads(sys.stdin.read())
    model = load_model(model_dir, dtype=dtype, device=device)
    batched_generate(model, prompts[:8], 8, model.config.pad_token_id)  # warm-up
    print(batched_generate(model, prompts, new_tokens, model.config.pad_token_id))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--sequential-requests", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="", help="HF model dir (default: the embedded tiny model)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server and of generate")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N: where the server and generate run")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="the model built when --model is not given")
    p.add_argument("--vllm", default="", metavar="PYTHON",
                   help="also measure a vLLM server: its interpreter, or 'auto' (.venv-vllm, else this one)")
    p.add_argument("--generate-worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.generate_worker:
        return generate_worker(args.generate_worker, args.new_tokens, args.threads, args.device, args.dtype)

    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    model_dir = args.model or str(build_model(args.shape, work / args.shape))
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(args.prompt_len)] for _ in range(args.episodes)]

    port = find_free_port()
    server = ServerProcess([sys.executable, "-m", "areal_pipeline.inference.server", "--model", model_dir,
                            "--port", str(port), "--log-level", "warning", "--num-threads", str(args.threads),
                            "--device", args.device, "--dtype", args.dtype], f"127.0.0.1:{port}",
                           work / "server.log").start()
    figures = {"server": [], "generate": [], "one_at_a_time": [], "vllm": []}
    vllm = None
    if args.vllm:
        from areal_pipeline.config import VLLMConfig
        from areal_pipeline.inference.vllm_client import RemoteVLLMEngine

        vllm_cfg = VLLMConfig(python="" if args.vllm == "auto" else args.vllm, dtype=args.dtype, max_model_len=1024)
        vllm_port = find_free_port()
        vllm = ServerProcess(build_vllm_command(model_dir, "127.0.0.1", vllm_port, vllm_cfg, seed=0),
                             f"127.0.0.1:{vllm_port}", work / "vllm.log", env=vllm_env(vllm_cfg, work, 0)).start()
    try:
        server.wait_healthy(120)
        if vllm is not None:
            vllm.wait_healthy(300)

            async def vllm_run():
                async with RemoteVLLMEngine([vllm.address]) as engine:
                    await through_server(engine, prompts[:8], 8, True)  # warm-up
                    return await through_server(engine, prompts, args.new_tokens, True)

        async def server_runs():
            async with RemoteSGLangEngine([server.address]) as engine:
                await through_server(engine, prompts[:8], 8, True)  # warm-up
                conc = await through_server(engine, prompts, args.new_tokens, True)
                seq = await through_server(engine, prompts[: args.sequential_requests], args.new_tokens, False)
                return conc, seq

        # Interleave the measurements so that drifts in machine load hit all three alike.
        for r in range(args.repeats):
            conc, seq = asyncio.run(server_runs())
            gen = generate_in_own_process(model_dir, prompts, args.new_tokens, args.threads, args.device, args.dtype)
            figures["server"].append(conc)
            figures["one_at_a_time"].append(seq)
            figures["generate"].append(gen)
            if vllm is not None:
                figures["vllm"].append(asyncio.run(vllm_run()))
            print(f"repeat {r}: server {conc:,.0f} tok/s | batched generate {gen:,.0f} tok/s | "
                  f"one at a time {seq:,.0f} tok/s"
                  + (f" | vLLM {figures['vllm'][-1]:,.0f} tok/s" if vllm is not None else ""), flush=True)
    finally:
        server.stop()
        if vllm is not None:
            vllm.stop()

    med = {k: statistics.median(v) for k, v in figures.items() if v}
    ratios = [server / generate for server, generate in zip(figures["server"], figures["generate"])]
    result = {
        "episodes": args.episodes,
        "device": args.device,
        "dtype": args.dtype,
        "shape": args.model or args.shape,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "tokens_per_s": round(med["server"], 1),
        "batched_generate_tokens_per_s": round(med["generate"], 1),
        "one_at_a_time_tokens_per_s": round(med["one_at_a_time"], 1),
        # within each repeat, then their median: a drift between repeats moves both sides of a ratio alike
        "server_vs_batched_generate": round(statistics.median(ratios), 3),
        "server_vs_batched_generate_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "server_vs_one_at_a_time": round(med["server"] / med["one_at_a_time"], 2),
    }
    if figures["vllm"]:
        vs = [v / s for v, s in zip(figures["vllm"], figures["server"])]
        result.update({"vllm_tokens_per_s": round(med["vllm"], 1), "vllm_vs_server": round(statistics.median(vs), 3),
                       "vllm_vs_server_range": [round(min(vs), 3), round(max(vs), 3)]})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
