"""The LoRA adapter a run's servers serve its policy as, where a push sends the adapter alone (trainer.lora.push) to
servers speaking SGLang's API: SGLang, and the project's server (lora_serving.py).

Each version is loaded under a name of its own (`policy-v7`: SGLang refuses to load a name it holds, and a new name
never reuses the old adapter's cached KV), every request names it (`lora_path`), and the name before is unloaded once
the new one serves, so a server holds the run's current adapter alone however many pushes there are. Every client of
a run (rollout, the asynchronous executor, evaluation, the weight probe) shares one `ServedAdapter`: a request names
the adapter current when it is sent, so a generation a push interrupted resumes on the new one.

vLLM loads each version in place under one name instead (vllm_client.py: it can, with `load_inplace`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional

from areal_pipeline.inference.server_error import InferenceServerError

PREFIX = "policy"


class AdapterPushError(RuntimeError):
    """A LoRA adapter a push sent did not reach a server."""

    def __init__(self, backend: str, address: str, adapter: str, path: str, version: int, reason: str):
        super().__init__(f"LoRA adapter {adapter} ({path}) did not reach {backend} server {address} at version "
                         f"{version}: {reason}")
        self.backend, self.address, self.adapter, self.version = backend, address, adapter, version


class ServedAdapter:
    """The adapter the servers serve now (None: the base, version 0 or before the first push), thread-safe."""

    def __init__(self, prefix: str = PREFIX):
        self.prefix = prefix
        self._lock = threading.Lock()
        self._name: Optional[str] = None
        self._version = 0  # servers start on the base, labelled 0

    def name_for(self, version: int) -> str:
        return f"{self.prefix}-v{version}"

    def ours(self, name: str) -> bool:
        return name.startswith(f"{self.prefix}-v")

    @property
    def name(self) -> Optional[str]:
        with self._lock:
            return self._name

    def serves(self, version: int) -> bool:
        """Whether this process pushed `version` as the servers' adapter (a process that did not push it cannot
        know what the servers' label stands for: it pushes again)."""
        with self._lock:
            return self._version == version and (version == 0 or self._name is not None)

    def set(self, name: Optional[str], version: int) -> None:
        with self._lock:
            self._name, self._version = name, version


def not_loaded(error: InferenceServerError) -> bool:
    """Whether a server refused a request for naming an adapter it does not hold (SGLang's words and the project
    server's), the refusal a request sent just before a push meets."""
    return error.status == 400 and ("are not loaded" in str(error) or "the base is not served" in str(error))


async def push_adapter(engine, path: str, version: int, backend: str) -> None:
    """Load the PEFT directory `path` as version `version`'s adapter on every server of `engine`, label new tokens
    with the version, and unload the run's adapters before it; AdapterPushError naming the server where any step
    fails. Call it with generation paused (requests sent meanwhile are refused, and resent by the client)."""
    served: ServedAdapter = engine.adapter
    if version == 0:  # the base itself: no adapter
        await _serve_base(engine, served, backend)
        return
    name = served.name_for(version)

    def stale(loaded: dict) -> list[str]:
        return [n for n in loaded if served.ours(n) and n != name]

    async def on(address: str) -> None:
        def failed(reason: str) -> AdapterPushError:
            return AdapterPushError(backend, address, name, path, version, reason)

        try:
            loaded = await _load(engine, address, name, path)
            await engine.request(address, "/update_weight_version",
                                 {"new_version": str(version), "abort_all_requests": False}, retries=0)
            for old in stale(loaded):
                loaded = (await engine.request(address, "/unload_lora_adapter", {"lora_name": old},
                                               retries=0)).get("loaded_adapters") or {}
        except InferenceServerError as e:
            raise failed(str(e)) from e
        if name not in loaded or stale(loaded):
            raise failed(f"the server holds {sorted(loaded)} after the push, not {name} alone")

    await asyncio.gather(*(on(a) for a in engine.addresses))
    served.set(name, version)
    engine.set_version(version)


async def _serve_base(engine, served: ServedAdapter, backend: str) -> None:
    """Version 0: every adapter of the run unloaded, the base labelled 0."""
    async def on(address: str) -> None:
        try:
            cards = (await engine.request(address, "/v1/models", method="GET", retries=0)).get("data") or []
            for name in [card.get("id", "") for card in cards if served.ours(card.get("id", ""))]:
                await engine.request(address, "/unload_lora_adapter", {"lora_name": name}, retries=0)
            await engine.request(address, "/update_weight_version", {"new_version": "0", "abort_all_requests": False},
                                 retries=0)
        except InferenceServerError as e:
            raise AdapterPushError(backend, address, "(none: the base)", "", 0, str(e)) from e

    await asyncio.gather(*(on(a) for a in engine.addresses))
    served.set(None, 0)
    engine.set_version(0)


async def _load(engine, address: str, name: str, path: str) -> dict:
    """Load `name` from `path` on `address`; a name the server holds already (a push of the same version again,
    from a process that did not know) is unloaded and loaded afresh. The server's adapters after the load."""
    payload = {"lora_name": name, "lora_path": path}
    try:
        return (await engine.request(address, "/load_lora_adapter", payload, retries=0)).get("loaded_adapters") or {}
    except InferenceServerError as e:
        if e.status != 400 or "already loaded" not in str(e):
            raise
    await engine.request(address, "/unload_lora_adapter", {"lora_name": name}, retries=0)
    return (await engine.request(address, "/load_lora_adapter", payload, retries=0)).get("loaded_adapters") or {}
