"""LoRA adapters on the project's server, loaded and unloaded at run time through SGLang's routes (`--enable-lora`):

    POST /load_lora_adapter   {"lora_name": "policy-v3", "lora_path": "/runs/r/weights/v3"}
    POST /unload_lora_adapter {"lora_name": "policy-v3"}
    POST /generate            {..., "lora_path": "policy-v3"}   (a name, as SGLang takes it; one per prompt or one for all)

Both answer SGLang's `LoRAUpdateOutput` ({"success", "error_message", "loaded_adapters": {name: path}}, 400 on
failure). The server serves one adapter at a time, merged into its base in place: the forward pass is the base's,
with no adapter products per token. A load first puts back the base tensors it changes from a copy kept of them
(peft's `unmerge` subtracts, and rounding would drift over thousands of loads), then adds s (B A) to each target
weight as the trainer computes its merged policy (training/lora.py: the served weights are bitwise the trainer's).

Where it differs from SGLang, because one adapter is merged: loading another evicts the loaded one (as SGLang evicts
past `--max-loaded-loras`, here 1), and the requests still running on the evicted one end as a pause ends them
(finish_reason abort, their tokens so far), so a client resends them naming the new one; the base is not served while
an adapter is loaded (a request naming none is refused, as is a request naming an adapter not loaded, with SGLang's
message); full-weight updates are refused until the adapter is unloaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Optional

import torch
from aiohttp import web

from areal_pipeline.http_json import RequestRejected, check_str, read_json_object, shown
from areal_pipeline.training import lora

# SGLang's words (lora_registry.py), so that a client written for it recognises the refusal
NOT_LOADED = "The following requested LoRA adapters are not loaded: {names}\nLoaded adapters: {loaded}."
EVICTED = "its LoRA adapter was unloaded"  # the abort message of a request running on an adapter another replaced
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
FACTORS = {"lora_A": 0, "lora_B": 1}


@dataclasses.dataclass
class AdapterWeights:
    """A PEFT adapter directory as read and checked: each target weight's (A, B) and the update's scale."""
    path: str
    rank: int
    scale: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # the base's weight name -> (A [r, in], B [out, r])


def lora_path_names(raw: Any, n_prompts: int, batched: bool) -> list[Optional[str]]:
    """`/generate`'s `lora_path` as one adapter name (or None) per prompt, as SGLang normalises it: a string names
    the adapter of every prompt, a list one per prompt of a batch."""
    if raw is None:
        return [None] * n_prompts
    if isinstance(raw, str):
        return [raw] * n_prompts
    if not (isinstance(raw, list) and all(p is None or type(p) is str for p in raw)):
        raise RequestRejected(f"lora_path should be a list or a string, got {shown(raw)}")
    if not batched or len(raw) != n_prompts:
        raise RequestRejected(f"lora_path list length ({len(raw)}) must match batch size ({n_prompts})")
    return list(raw)


def read_adapter(path: str, weights: dict[str, torch.Tensor], max_rank: int, targets: list[str]) -> AdapterWeights:
    """Read the PEFT directory at `path` and check it against the served model (`weights`: its state dict), any
    thread: RequestRejected naming what does not fit, before anything is merged."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    directory = Path(path)
    try:
        config = LoraConfig.from_pretrained(str(directory))
    except Exception as e:  # a missing or malformed adapter_config.json
        raise RequestRejected(f"no readable PEFT adapter config at {path}: {type(e).__name__}: {e}") from None
    if getattr(config, "use_dora", False):
        raise RequestRejected(f"the adapter at {path} is a DoRA adapter: LoRA serving does not support DoRA adapters")
    if config.bias != "none" or config.modules_to_save or config.fan_in_fan_out:
        raise RequestRejected(f"the adapter at {path} has bias={config.bias!r}, modules_to_save="
                              f"{config.modules_to_save!r}, fan_in_fan_out={config.fan_in_fan_out}: served are "
                              "adapters of the linear layers' weights alone")
    if config.r > max_rank:
        raise RequestRejected(f"the adapter at {path} has rank {config.r}, above this server's --max-lora-rank "
                              f"{max_rank}")
    try:
        saved = load_file(str(directory / "adapter_model.safetensors"))
    except Exception as e:  # missing, truncated, not safetensors
        raise RequestRejected(f"cannot read the adapter's weights at {directory / 'adapter_model.safetensors'}: "
                              f"{e}") from None
    pairs: dict[str, list[Optional[torch.Tensor]]] = {}
    for key, tensor in saved.items():
        layer, factor = _split_key(key, path)
        pairs.setdefault(f"{layer}.weight", [None, None])[FACTORS[factor]] = tensor
    if not pairs:
        raise RequestRejected(f"the adapter at {path} holds no LoRA weights")
    factors = {}
    for name, (a, b) in sorted(pairs.items()):
        _check_factors(name, a, b, weights, config.r, targets, path)
        factors[name] = (a.float(), b.float())
    return AdapterWeights(path=path, rank=config.r, scale=lora.scaling_of(config.lora_alpha, config.r,
                                                                          config.use_rslora), factors=factors)


def _split_key(key: str, path: str) -> tuple[str, str]:
    """'base_model.model.<layer>.lora_A.weight' -> ('<layer>', 'lora_A')."""
    stem = key.removeprefix(lora.WRAPPED_PREFIX)
    for factor in FACTORS:
        if stem.endswith(f".{factor}.weight"):
            return stem[: -len(f".{factor}.weight")], factor
    raise RequestRejected(f"the adapter at {path} holds {key!r}, which is not a LoRA A or B weight")


def _check_factors(name: str, a: Optional[torch.Tensor], b: Optional[torch.Tensor], weights: dict[str, torch.Tensor],
                   rank: int, targets: list[str], path: str) -> None:
    if name not in weights:
        raise RequestRejected(f"the adapter at {path} adapts {name!r}, which this model does not have")
    module = name.rsplit(".", 2)[-2]
    if "all" not in targets and module not in targets:
        raise RequestRejected(f"the adapter at {path} targets {module}, not among this server's "
                              f"--lora-target-modules {' '.join(targets)}")
    if a is None or b is None:
        raise RequestRejected(f"the adapter at {path} has {'no lora_A' if a is None else 'no lora_B'} for {name}")
    out_features, in_features = weights[name].shape
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise RequestRejected(f"the adapter at {path} has A {tuple(a.shape)} and B {tuple(b.shape)} for {name} "
                              f"{tuple(weights[name].shape)}, not ({rank}, {in_features}) and ({out_features}, {rank})")
    if not (a.is_floating_point() and b.is_floating_point() and torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise RequestRejected(f"the adapter at {path} holds non-finite or non-float values for {name}")


class MergedAdapter:
    """The adapter merged into the served model, and the base tensors it replaced. Used on the engine thread only."""

    def __init__(self):
        self.name: Optional[str] = None
        self.path: Optional[str] = None
        self._pristine: dict[str, torch.Tensor] = {}  # the base's own values of the weights an adapter changed

    def loaded(self) -> dict[str, str]:
        return {self.name: self.path} if self.name is not None else {}

    def merge(self, model: torch.nn.Module, name: str, adapter: AdapterWeights) -> None:
        params = dict(model.named_parameters())
        self._restore(params)
        with torch.no_grad():
            for weight, (a, b) in adapter.factors.items():
                target = params[weight]
                base = self._pristine.setdefault(weight, target.detach().clone())
                target.copy_(lora.merge_weight(base.float(), a, b, adapter.scale).to(target.dtype))
        self.name, self.path = name, adapter.path

    def unmerge(self, model: torch.nn.Module) -> None:
        self._restore(dict(model.named_parameters()))
        self._pristine.clear()
        self.name = self.path = None

    def _restore(self, params: dict[str, torch.nn.Parameter]) -> None:
        with torch.no_grad():
            for weight, base in self._pristine.items():
                params[weight].copy_(base)


class LoRARoutes:
    def __init__(self, server, disk_refusal):
        """`server`: the InferenceServer (its engine and arguments); `disk_refusal(path, patterns)`: why the files at
        `path` may not be read (None: they may; the weight routes' --weights-root confinement)."""
        self.server = server
        self.disk_refusal = disk_refusal
        args = server.server_args or {}
        self.enabled = bool(args.get("enable_lora"))
        self.max_rank = int(args.get("max_lora_rank") or 0)
        self.targets = list(args.get("lora_target_modules") or ["all"])
        self._lock = asyncio.Lock()  # one load or unload at a time, as SGLang's lora_update_lock

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)

    def _reply(self, success: bool, message: str = "", status: int = 400) -> web.Response:
        """SGLang's LoRAUpdateOutput, with the adapters held now."""
        loaded = self.server.engine.adapter.loaded()
        return web.json_response({"success": success, "error_message": message, "loaded_adapters": loaded},
                                 status=200 if success else status)

    async def _body(self, request: web.Request) -> dict | web.Response:
        """The request's JSON object, or the answer that refuses it: the server not ready, or LoRA not enabled."""
        if (not_ready := self.server._require_ready()) is not None:
            return not_ready
        body = await read_json_object(request)
        return body if self.enabled else self._reply(False, NOT_ENABLED)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        if isinstance(body := await self._body(request), web.Response):
            return body
        name, path = check_str("lora_name", body.get("lora_name")), check_str("lora_path", body.get("lora_path"))
        engine = self.server.engine
        refusal = await asyncio.to_thread(self.disk_refusal, path, ("*.safetensors", "*.json"))
        if refusal is not None:
            return self._reply(False, refusal, status=403)
        async with self._lock:
            if name == engine.adapter.name:  # SGLang's words
                return self._reply(False, f"Failed to load LoRA adapter {name} because it is already loaded")
            weights = await asyncio.wrap_future(engine.call(lambda: dict(engine.model.state_dict())))
            try:
                adapter = await asyncio.to_thread(read_adapter, path, weights, self.max_rank, self.targets)
            except RequestRejected as e:
                return self._reply(False, f"Failed to load LoRA adapter {name}: {e}")
            await asyncio.wrap_future(engine.load_adapter(name, adapter))
        return self._reply(True)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        if isinstance(body := await self._body(request), web.Response):
            return body
        name = check_str("lora_name", body.get("lora_name"))
        engine = self.server.engine
        async with self._lock:
            if name != engine.adapter.name:  # SGLang's registry's words
                return self._reply(False, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                          f"{list(engine.adapter.loaded())}")
            await asyncio.wrap_future(engine.unload_adapter())
        return self._reply(True)


def refusal_for(names: list[Optional[str]], loaded: Optional[str]) -> Optional[str]:
    """Why requests naming `names` cannot run on a server serving adapter `loaded` (None: the base), or None."""
    wrong = sorted({n for n in names if n != loaded and n is not None})
    if wrong:
        return NOT_LOADED.format(names=", ".join(wrong), loaded=[loaded] if loaded else [])
    if loaded is not None and None in names:
        return (f"this server serves LoRA adapter {loaded!r} merged into its base, so the base is not served while it "
                f"is loaded: name it (lora_path) or unload it first")
    return None


def base_locked(name: str) -> str:
    """Why the base's weights may not be updated while adapter `name` is merged into them."""
    return (f"LoRA adapter {name!r} is merged into the served base: unload it (/unload_lora_adapter) before "
            "updating the base's weights")
