"""LoRA adapter pushes to servers speaking SGLang's API (areal_pipeline/inference/adapters.py), checked against SGLang's
own code of both supported releases (read from their wheels: request fields, lora_path normalisation, the adapter
config reader, the launch flags) and against the project's server: every version loaded under its own name, the one
before unloaded (two held at most, one after the push), generations a push interrupts resumed on the new adapter."""

from __future__ import annotations

import ast
import asyncio
import types

import pytest
from aiohttp import web

import _sglang_reference as ref
from areal_pipeline.config.schema import LoRAConfig, SGLangConfig
from areal_pipeline.inference.adapters import AdapterPushError, ServedAdapter
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.inference.launcher import build_sglang_command
from areal_pipeline.inference.types import ModelRequest, SamplingParams
from conftest import start_cpu_server
from test_lora_server import make_adapter

IO_STRUCT = "sglang/srt/managers/io_struct.py"
REQUESTS = ("LoadLoRAAdapterReqInput", "UnloadLoRAAdapterReqInput", "UpdateWeightVersionReqInput")


def request_fields(version: str) -> dict[str, tuple[set[str], set[str]]]:
    """SGLang's request classes of `version`: class -> (every field, the required ones)."""
    tree = ast.parse(ref.source(version, IO_STRUCT))
    fields = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in REQUESTS:
            annotated = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            fields[node.name] = ({s.target.id for s in annotated}, {s.target.id for s in annotated if s.value is None})
    assert set(fields) == set(REQUESTS), f"SGLang {version} no longer defines {set(REQUESTS) - set(fields)}"
    return fields


class SGLangDouble:
    """SGLang's adapter routes as its tokenizer manager answers them (0.5.23's tokenizer_control_mixin.py and
    lora_registry.py): names in LRU order, a load past --max-loaded-loras evicting the least recently used, a name
    loaded twice refused, an unknown unload refused, a request naming an adapter not loaded refused; every body
    recorded by route."""

    def __init__(self, max_loaded: int = 2):
        self.max_loaded = max_loaded
        self.loaded: dict[str, str] = {}
        self.bodies: dict[str, list[dict]] = {}
        self.most_held = 0

    def reply(self, success: bool, message: str = "") -> web.Response:
        return web.json_response({"success": success, "error_message": message, "loaded_adapters": dict(self.loaded)},
                                 status=200 if success else 400)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.setdefault(request.path, []).append(body)
        if request.path == "/load_lora_adapter":
            if body["lora_name"] in self.loaded:
                return self.reply(False, f"Failed to load LoRA adapter {body['lora_name']} because it is already "
                                         "loaded")
            self.loaded[body["lora_name"]] = body["lora_path"]
            self.most_held = max(self.most_held, len(self.loaded))
            while len(self.loaded) > self.max_loaded:
                self.loaded.pop(next(iter(self.loaded)))
            return self.reply(True)
        if request.path == "/unload_lora_adapter":
            if body["lora_name"] not in self.loaded:
                return self.reply(False, f"LoRA with name {body['lora_name']} does not exist. Loaded LoRAs: "
                                         f"{self.loaded.keys()}")
            del self.loaded[body["lora_name"]]
            return self.reply(True)
        if request.path == "/update_weight_version":
            return web.json_response({"success": True, "new_version": body["new_version"]})
        return web.json_response({"status": "ok"})  # /pause_generation, /continue_generation


async def serve_double(double: SGLangDouble) -> tuple[web.AppRunner, str]:
    app = web.Application()
    for path in ("/load_lora_adapter", "/unload_lora_adapter", "/update_weight_version", "/pause_generation",
                 "/continue_generation"):
        app.router.add_post(path, double.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


@pytest.mark.parametrize("version", ref.VERSIONS)
def test_pushes_send_what_sglangs_request_classes_take_and_hold_one_adapter(version, tmp_path):
    """30 pushes to two servers: each loads its version's adapter under a name of its own, labels the version and
    unloads the one before, in SGLang's request fields; no server ever holds more than two, and each ends with the
    last alone."""
    fields = request_fields(version)
    doubles = [SGLangDouble(), SGLangDouble()]

    async def pushes():
        runners = [await serve_double(d) for d in doubles]
        engine = RemoteSGLangEngine([address for _, address in runners], adapter=ServedAdapter(), kind="sglang")
        try:
            for k in range(1, 31):
                await engine.update_weights(str(tmp_path / f"v{k}"), k)
                assert engine.adapter.name == f"policy-v{k}" and engine.get_version() == k
                assert engine._generate_payload(ModelRequest(input_ids=[1], sampling=SamplingParams(max_new_tokens=2)), [])[
                    "lora_path"] == f"policy-v{k}"
        finally:
            await engine.close()
            for runner, _ in runners:
                await runner.cleanup()
    asyncio.run(pushes())
    for double in doubles:
        assert double.loaded == {"policy-v30": str(tmp_path / "v30")} and double.most_held == 2
        assert [b["lora_name"] for b in double.bodies["/unload_lora_adapter"]] == [f"policy-v{k}" for k in range(1, 30)]
        for path, name in (("/load_lora_adapter", "LoadLoRAAdapterReqInput"),
                           ("/unload_lora_adapter", "UnloadLoRAAdapterReqInput"),
                           ("/update_weight_version", "UpdateWeightVersionReqInput")):
            every, required = fields[name]
            for body in double.bodies[path]:
                assert required <= set(body) <= every, (path, body, every)
        assert double.bodies["/update_weight_version"][-1] == {"new_version": "30", "abort_all_requests": False}


@pytest.mark.parametrize("version", ref.VERSIONS)
def test_a_batchs_lora_path_is_normalised_by_sglang_to_one_name_per_prompt(version):
    code = ref.source(version, IO_STRUCT)
    normalise = ref.definitions(code, ["GenerateReqInput._normalize_lora_paths"], {})[
        "GenerateReqInput._normalize_lora_paths"]
    engine = RemoteSGLangEngine(["127.0.0.1:1"], adapter=ServedAdapter())
    engine.adapter.set("policy-v4", 4)
    payload = engine._generate_payload(ModelRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=3)), [])
    request = types.SimpleNamespace(lora_path=payload["lora_path"], parallel_sample_num=1)
    normalise(request, 3)  # the batch form sends the one name for every prompt of the group
    assert request.lora_path == ["policy-v4"] * 3


@pytest.mark.parametrize("version", ref.VERSIONS)
def test_sglangs_adapter_config_reader_takes_the_trainers_adapter_and_its_flags_are_sglangs(version, tiny_model_dir,
                                                                                         tmp_path, monkeypatch):
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", seed=1, rank=8)
    monkeypatch.syspath_prepend(str(ref.wheel(version)))
    # sglang/__init__ and sglang/srt/__init__ import the whole runtime: the reader's module alone
    for package in ("sglang", "sglang.srt", "sglang.srt.lora"):
        module = types.ModuleType(package)
        module.__path__ = [f"{ref.wheel(version)}/{package.replace('.', '/')}"]
        monkeypatch.setitem(__import__("sys").modules, package, module)
    monkeypatch.delitem(__import__("sys").modules, "sglang.srt.lora.lora_config", raising=False)
    from sglang.srt.lora.lora_config import LoRAConfig as SGLangLoRAConfig

    config = SGLangLoRAConfig(str(adapter))
    assert (config.r, config.lora_alpha, getattr(config, "use_dora", False)) == (8, 16.0, False)
    assert config.target_modules == "all-linear" or set(config.target_modules) >= {"q_proj", "down_proj"}
    command = build_sglang_command("/m", "127.0.0.1", 1, SGLangConfig(), 0, lora=LoRAConfig(enabled=True, rank=8))
    lora_flags = command[command.index("--enable-lora"):]
    assert lora_flags[:11] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
                               "--max-loras-per-batch", "1", "--max-loaded-loras", "2"][:11]
    flags = [f for f in lora_flags if f.startswith("--")]
    if version == "0.5.10.post1":
        source = ref.source(version, "sglang/srt/server_args.py")
        assert all(f'"{flag}"' in source for flag in flags), flags
    else:
        source = ref.source(version, "sglang/srt/arg_groups/fields/lora.py")
        assert all(f"    {flag[2:].replace('-', '_')}: A[" in source for flag in flags), flags


@pytest.fixture(scope="module")
def adapters_server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-lora")
    server = start_cpu_server(tiny_model_dir, root, "--weights-root", str(root), "--enable-lora",
                              "--max-lora-rank", "8")
    adapters = [make_adapter(tiny_model_dir, root / f"v{k}", seed=k) for k in (1, 2)]
    yield server.address, adapters, root
    server.stop()


def test_generations_a_push_interrupts_resume_on_the_new_adapter(adapters_server):
    """As asynchronous training pushes while episodes generate: the push pauses the server (running requests come
    back with their tokens so far), loads the next adapter, and the client resends them naming it; their tokens
    are labelled with the version of the adapter that sampled them."""
    address, (v1, v2), _ = adapters_server

    async def run():
        engine = RemoteSGLangEngine([address], adapter=ServedAdapter(), kind="cpu")
        try:
            await engine.update_weights(str(v1), 1)
            requests = [ModelRequest(input_ids=[258, 117, 115], sampling=SamplingParams(max_new_tokens=600, ignore_eos=True,
                                                                     temperature=1.0)) for _ in range(2)]
            group = asyncio.ensure_future(engine.agenerate_group(requests))
            while not (await engine.request(address, "/server_info", method="GET"))[
                    "internal_states"][0]["running_requests"]:
                await asyncio.sleep(0.01)
            await engine.update_weights(str(v2), 2)
            replies = await asyncio.wait_for(group, 120)
            models = await engine.request(address, "/v1/models", method="GET")
            return replies, [m["id"] for m in models["data"][1:]]
        finally:
            await engine.update_weights("", 0)  # the base again, for the next test
            await engine.close()
    replies, loaded = asyncio.run(run())
    assert loaded == ["policy-v2"]
    for reply in replies:
        assert len(reply.output_tokens) == 600 and reply.stop_reason == "length"
        assert reply.output_versions[0] == 1 and reply.output_versions[-1] == 2, reply.output_versions
        assert sorted(set(reply.output_versions)) == [1, 2]


class RacingAdapter(ServedAdapter):
    """The registry as a request built just before a push sees it: its first read is the old name."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    @property
    def name(self):
        self.reads += 1
        return "policy-v1" if self.reads == 1 else "policy-v2"


def test_a_request_sent_naming_the_adapter_a_push_replaced_is_resent_on_the_new_one(adapters_server):
    address, (v1, v2), _ = adapters_server

    async def run():
        engine = RemoteSGLangEngine([address], adapter=ServedAdapter(), kind="cpu")
        try:
            await engine.update_weights(str(v2), 2)
            engine.adapter = RacingAdapter()
            reply = await engine.agenerate(ModelRequest(input_ids=[258, 117], sampling=SamplingParams(max_new_tokens=4,
                                                                                  ignore_eos=True)))
            engine.adapter = ServedAdapter()
            engine.adapter.set("policy-v2", 2)
            return reply
        finally:
            await engine.update_weights("", 0)
            await engine.close()
    reply = asyncio.run(run())
    assert len(reply.output_tokens) == 4 and reply.output_versions == [2] * 4


def test_a_load_the_server_refuses_is_an_error_naming_the_server_adapter_and_version(adapters_server, tmp_path):
    address, _, root = adapters_server
    outside = tmp_path / "v3"  # not under the server's --weights-root
    outside.mkdir()

    async def run():
        engine = RemoteSGLangEngine([address], adapter=ServedAdapter(), kind="cpu")
        try:
            await engine.update_weights(str(outside), 3)
        finally:
            await engine.close()
    with pytest.raises(AdapterPushError) as failed:
        asyncio.run(run())
    error = failed.value
    assert (error.backend, error.address, error.adapter, error.version) == ("cpu", address, "policy-v3", 3)
    assert f"LoRA adapter policy-v3 ({outside}) did not reach cpu server {address} at version 3" in str(error)
    assert "--weights-root" in str(error)
