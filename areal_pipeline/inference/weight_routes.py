"""The CPU server's weight routes: `/update_weights_from_disk`, `/get_weights_by_name` and the weight-update group's
(`/init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group`), as SGLang has
them. The group is joined as SGLang joins it (areal_pipeline/training/weight_group.py).

Unlike SGLang, a server takes weights only from its trainer (issue #48): a disk load only from inside a
--weights-root (confined_paths.py), a group only with a --weight-group-master where any is given, and never a
second group while it holds one (a server serves one trainer: a group from elsewhere would let another process
overwrite the weights the run is sampling from)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any, Optional

import torch
from aiohttp import web

from areal_pipeline.confined_paths import OutsideRoots, confine, resolve_roots
from areal_pipeline.http_json import check_bool, check_int, check_str, read_json_object, shown
from areal_pipeline.inference.engine import RequestError
from areal_pipeline.inference.lora_serving import base_locked


def _given(body: dict, key: str, default: Any) -> Any:
    """`body[key]`, or `default` when it is absent or null (SGLang's optional fields take null)."""
    value = body.get(key)
    return default if value is None else value


class WeightRoutes:
    def __init__(self, server):
        """`server`: the InferenceServer (its `engine` and `_require_ready`)."""
        self.server = server
        self.weight_groups: dict[str, Any] = {}  # group_name -> (process group, its backend)
        self.group_masters: dict[str, str] = {}  # group_name -> master address, of groups held or being joined
        args = getattr(server, "server_args", None) or {}
        self.weights_roots: list[str] = list(args.get("weights_root") or [])
        self.masters: list[str] = [_bare(m) for m in args.get("weight_group_master") or []]

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_route("*", "/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        if (not_ready := self.server._require_ready()) is not None:
            return not_ready
        body = await read_json_object(request)
        if body.get("model_path") is None:
            raise RequestError("model_path is required")
        path = check_str("model_path", body["model_path"])
        if body.get("load_format") not in (None, "safetensors", "auto"):
            raise RequestError("the CPU server loads safetensors weights only")
        version = _weight_version(body)
        abort_all = check_bool("abort_all_requests", _given(body, "abort_all_requests", False))
        check_bool("flush_cache", _given(body, "flush_cache", True))
        # after the fields' checks (their 400s come first, as on SGLang), before anything at the path is read
        refusal = await asyncio.to_thread(self.disk_refusal, path)
        if refusal is not None:
            return web.json_response({"success": False, "message": refusal, "num_paused_requests": 0}, status=403)
        if self.server.engine.adapter.name is not None:
            return web.json_response({"success": False, "message": base_locked(self.server.engine.adapter.name),
                                      "num_paused_requests": 0}, status=400)
        started = time.perf_counter()
        try:  # read and checked before any weight is swapped in, off the engine thread: generation goes on meanwhile
            engine = self.server.engine
            state = await asyncio.to_thread(read_weights, engine.model, engine.device, path)
        except RequestError as e:
            return web.json_response({"success": False, "message": str(e), "num_paused_requests": 0}, status=400)
        if abort_all:
            await asyncio.wrap_future(self.server.engine.abort(abort_all=True))
        num_paused = self.server.engine.num_running()
        count = await asyncio.wrap_future(self.server.engine.load_weights(state, version))
        return web.json_response({
            "success": True,
            "message": f"Succeeded to update model weights ({count} tensors in "
                       f"{time.perf_counter() - started:.3f}s); weight_version={self.server.engine.weight_version}",
            "num_paused_requests": num_paused,
            "weight_version": self.server.engine.weight_version,
        })

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """SGLang's: the label new tokens carry (after a LoRA adapter's load, say); `abort_all_requests` (default
        true, as SGLang's) ends the running requests first, as aborted."""
        body = await read_json_object(request)
        version = _weight_version({"weight_version": body.get("new_version")})
        if version is None:
            raise RequestError("new_version is required")
        engine = self.server.engine
        if check_bool("abort_all_requests", _given(body, "abort_all_requests", True)):
            await asyncio.wrap_future(engine.abort(abort_all=True))

        def label():
            engine.weight_version = version
        await asyncio.wrap_future(engine.call(label))
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        from areal_pipeline.training.weight_group import join_weight_group

        body = await read_json_object(request)
        for key in ("master_address", "master_port", "rank_offset", "world_size"):
            if body.get(key) is None:
                raise RequestError(f"init_weights_update_group needs master_address, master_port, rank_offset and "
                                   f"world_size: '{key}' is missing")
        backend = check_str("backend", _given(body, "backend", "gloo"))
        address = check_str("master_address", body["master_address"])
        port = check_int("master_port", _integer(body["master_port"]), minimum=1, maximum=65535)
        # rank 0 is the trainer's; a world too small for this rank would wait out the whole group timeout
        rank = check_int("rank_offset", _integer(body["rank_offset"]), minimum=1)
        world_size = check_int("world_size", _integer(body["world_size"]), minimum=rank + 1)
        args = (backend, address, port, rank, world_size, _group_name(body))
        if args[0] not in ("gloo", "nccl"):
            raise RequestError(f"unknown weight-update backend {args[0]!r}; valid: gloo, nccl")
        if args[0] == "nccl" and self.server.engine.device.type != "cuda":
            raise RequestError(f"this server runs on {self.server.engine.device}: it joins weight-update groups over "
                               "gloo, not 'nccl' (NCCL needs the server on a GPU: --device cuda)")
        # As SGLang: this server's one TP rank joins as rank_offset + 0, through torch's tcp:// rendezvous; a name
        # it already holds is refused by torch, as on SGLang (/destroy_weights_update_group frees it)
        backend, address, port, rank, world_size, name = args
        if self.masters and not await asyncio.to_thread(_among, address, self.masters):
            return web.json_response({"success": False, "message": (
                f"refused to join weight-update group {name} at master_address {address!r}: this server joins groups "
                f"only with its trainer at {', '.join(self.masters)} (--weight-group-master)")}, status=403)
        if (held := self._held_refusal(name, address)) is not None:
            return web.json_response({"success": False, "message": held}, status=409)
        fresh = name not in self.group_masters
        self.group_masters.setdefault(name, address)  # claimed before the join's wait: a second caller sees it
        try:  # joining blocks until every member is there: keep it off the event loop and the engine
            group = await asyncio.get_running_loop().run_in_executor(
                None, lambda: join_weight_group(backend, address, port, rank, world_size, name))
        except Exception as e:
            if fresh and name not in self.weight_groups:
                self.group_masters.pop(name, None)
            return web.json_response({"success": False,
                                      "message": f"Failed to initialize custom process group: {e}."}, status=400)
        self.weight_groups[name] = (group, backend)
        return web.json_response({"success": True, "message": f"joined {name} as rank {rank} of {world_size}"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await read_json_object(request)
        name = _group_name(body)
        names, dtypes, shapes = _announced_tensors(body)
        check_bool("flush_cache", _given(body, "flush_cache", True))
        version = _weight_version(body)
        abort_all = check_bool("abort_all_requests", _given(body, "abort_all_requests", False))
        if name not in self.weight_groups:  # SGLang's scheduler asserts here and the server dies; refused clearly
            return web.json_response({"success": False, "message": f"Group {name} not in "
                                      f"{sorted(self.weight_groups)}. Please call `init_weights_update_group` "
                                      "first."}, status=400)
        # Every announced tensor is checked against the model before any is received: one that cannot be taken
        # refuses the whole update with the model untouched (the trainer's broadcast then fails, rather than the
        # model holding half an update).
        await asyncio.wrap_future(self.server.engine.call(lambda: self._check_against_model(names, dtypes, shapes)))
        if abort_all:
            await asyncio.wrap_future(self.server.engine.abort(abort_all=True))
        try:
            group, backend = self.weight_groups[name]
            count = await asyncio.wrap_future(self.server.engine.update_weights_from_group(
                group, backend, names, dtypes, shapes, version))
        except Exception as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": f"updated {count} tensors; "
                                  f"weight_version={self.server.engine.weight_version}"})

    def _check_against_model(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        from areal_pipeline.training.weight_sync import DTYPES as WIRE_DTYPES

        params = self.server.engine.model.state_dict()
        for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
            if name not in params:
                raise RequestError(f"names[{i}]: this model has no tensor {name!r}")
            if dtype not in WIRE_DTYPES:
                raise RequestError(f"dtypes[{i}]: unknown dtype {dtype!r} for {name}; valid: "
                                   f"{', '.join(sorted(WIRE_DTYPES))}")
            if list(params[name].shape) != shape:
                raise RequestError(f"shapes[{i}]: {name} has shape {list(params[name].shape)}, not {shape}")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_json_object(request)
        from areal_pipeline.training.weight_group import destroy_weight_group

        removed = self.weight_groups.pop(_group_name(body), None)
        if removed is None:  # SGLang's words and status
            return web.json_response({"success": False, "message": "The group to be destroyed does not exist."},
                                     status=400)
        self.group_masters.pop(_group_name(body), None)  # left: any group may be joined now
        await asyncio.get_running_loop().run_in_executor(None, destroy_weight_group, removed[0])
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    def disk_refusal(self, path: str, patterns: tuple[str, ...] = ("*.safetensors",)) -> Optional[str]:
        """Why `path` may not be loaded (None: it may): it, and every file of `patterns` the load reads there, must
        resolve inside a --weights-root (a file linked out of one is refused as the path would be)."""
        if not self.weights_roots:
            return (f"refused to load weights from {path!r}: this server loads weights from disk only inside a "
                    "directory it is given with --weights-root DIR, and was started with none")
        roots = resolve_roots(self.weights_roots)
        try:
            where = confine(path, roots, "model_path")
            for file in sorted(f for p in patterns for f in where.glob(p)) if where.is_dir() else []:
                confine(file, roots, f"the weight file {str(file)!r} of {path!r}")
        except OutsideRoots as e:
            return f"refused to load weights: {e} (--weights-root)"
        return None

    def _held_refusal(self, name: str, address: str) -> Optional[str]:
        """Why a join of group `name` at `address` is refused while this server holds (or joins) a group: it serves
        one trainer. The same group from the same master goes on to the join (torch refuses a name still held);
        after /destroy_weights_update_group any group may be joined."""
        if name in self.group_masters and name not in self.weight_groups:
            return f"refused to join weight-update group {name}: a join of it is under way"
        if not self.group_masters or self.group_masters.get(name) == address:
            return None
        held = ", ".join(f"{n} (master {m})" for n, m in sorted(self.group_masters.items()))
        return (f"refused to join weight-update group {name} at master {address}: this server is already in "
                f"weight-update group {held}, and joins no other until it is left (/destroy_weights_update_group)")

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await read_json_object(request) if request.method == "POST" else dict(request.query)
        name = check_str("name", body.get("name"))
        truncate = _given(body, "truncate_size", 100)
        if isinstance(truncate, str) and truncate.isdigit():  # from a query string
            truncate = int(truncate)
        truncate = check_int("truncate_size", truncate, minimum=0)

        def read():
            params = dict(self.server.engine.model.named_parameters())
            if name not in params:
                raise RequestError(f"no parameter named {name!r}")
            return params[name].detach().float().flatten()[:truncate].tolist()

        return web.json_response(await asyncio.wrap_future(self.server.engine.call(read)))


def read_weights(model: torch.nn.Module, device: torch.device, model_path: str) -> dict[str, torch.Tensor]:
    """Read a checkpoint's safetensors and check them against the model, on any thread (generation goes on
    meanwhile): every file readable, every tensor one of the model's, of its shape, floating point and
    finite, none missing. RequestError otherwise, so a bad checkpoint leaves the served weights as they were."""
    from safetensors.torch import load_file

    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() and f.suffix == ".safetensors" for f in files):
        raise RequestError(f"no safetensors weights found at {path}")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f), device=str(device)))
        except Exception as e:  # truncated or not safetensors at all
            raise RequestError(f"cannot read weights from {f}: {e}") from None
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise RequestError(f"weights at {path} hold tensors this model does not have: {unknown[:5]}")
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(own) - set(state) - tied)
    if missing:
        raise RequestError(f"weights at {path} lack tensors: {missing[:5]}")
    for name, tensor in state.items():
        if own[name].shape != tensor.shape:
            raise RequestError(f"tensor {name}: shape {tuple(tensor.shape)} != model's {tuple(own[name].shape)}")
        if not tensor.is_floating_point():
            raise RequestError(f"tensor {name} at {path} is {tensor.dtype}, not floating point")
        if not torch.isfinite(tensor).all():
            raise RequestError(f"tensor {name} at {path} holds NaN or infinite values")
    return state


def _announced_tensors(body: dict) -> tuple[list[str], list[str], list[list[int]]]:
    """The names, dtypes and shapes of an update, checked for form (one entry each per tensor)."""
    for field in ("names", "dtypes", "shapes"):
        if body.get(field) is None:  # required, as in SGLang's request
            raise RequestError(f"'{field}' is required: the update announces each tensor's name, dtype and shape")
    names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
    for field, value in (("names", names), ("dtypes", dtypes)):
        if not (isinstance(value, list) and all(type(v) is str for v in value)):
            raise RequestError(f"'{field}' must be a list of strings, got {shown(value)}")
    if not (isinstance(shapes, list)
            and all(isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) for shape in shapes)):
        raise RequestError(f"'shapes' must be a list of lists of non-negative integers, got {shown(shapes)}")
    if not len(names) == len(dtypes) == len(shapes):
        raise RequestError(f"names, dtypes and shapes must have one entry per tensor; got {len(names)} names, "
                           f"{len(dtypes)} dtypes and {len(shapes)} shapes")
    return names, dtypes, shapes


def _integer(value: Any) -> Any:
    """A number given as a string of digits as an int (SGLang's pydantic fields take those); anything else as is."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


def _weight_version(body: dict) -> Optional[str]:
    version = body.get("weight_version")
    if version is not None and type(version) not in (str, int):
        raise RequestError(f"'weight_version' must be a string, got {shown(version)}")
    return None if version is None else str(version)


def _bare(host: str) -> str:
    return host.strip().strip("[]").lower()


def _among(address: str, masters: list[str]) -> bool:
    """Whether `address` names one of `masters`: the same name, or a name for one of their addresses."""
    if _bare(address) in masters:
        return True
    wanted = set().union(*(_addresses(m) for m in masters))
    return bool(wanted & _addresses(_bare(address)))


def _addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return set()


def _group_name(body: dict) -> str:
    return check_str("group_name", _given(body, "group_name", "weight_update_group"))
