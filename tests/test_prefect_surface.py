"""What the project uses of Prefect (and of the standard library's forkserver), checked against the installed
release: a Prefect release that removes or renames a name the code imports, or changes a call the code makes,
fails here before it fails a run. pyproject.toml pins Prefect to a range; this is what makes the range honest.
No private name of another package is used but the wrapped ones, each with its test (Prefect's engine entry
point `run_flow` behind flows/created_runs.py)."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROJECT_DIRS = ("areal_pipeline", "flows", "tasks")


def _prefect_imports() -> dict[tuple[str, str], list[str]]:
    """(module, name) -> where, for every `from prefect... import name` and `import prefect...` in the project,
    inside functions too (name "" for a module import)."""
    found: dict[tuple[str, str], list[str]] = {}
    for directory in PROJECT_DIRS:
        for path in sorted((REPO / directory).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "prefect":
                    for alias in node.names:
                        found.setdefault((node.module, alias.name), []).append(where)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.split(".")[0] == "prefect":
                            found.setdefault((alias.name, ""), []).append(where)
    return found


def test_the_project_imports_prefect_names_that_exist_and_none_is_private():
    used = _prefect_imports()
    assert len(used) > 20, used  # the scan sees the flows' imports
    private = {key: where for key, where in used.items()
               if any(part.startswith("_") for part in [*key[0].split("."), key[1]] if part)}
    assert not private, f"private Prefect names imported: {private}"
    missing = []
    for (module, name), where in used.items():
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{module} ({e}) at {where}")
            continue
        if name and not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name} at {where}")
    assert not missing, missing


# The one private name used where no public way exists, behind one function with a test of its own
# (tests/test_weight_group.py): torch's helper that makes a process group of a store's members.
ALLOWED_PRIVATE = {("areal_pipeline/training/weight_group.py", "c10d", "_new_process_group_helper"),
                   ("areal_pipeline/training/weight_group.py", "c10d", "_world")}
# transformers' attention implementation, read by name in one function (see the test below)
ALLOWED_BY_NAME = {("areal_pipeline/training/engine.py", "_attn_implementation")}
OWN_PACKAGES = {"areal_pipeline", "flows", "tasks"}


def test_no_private_name_of_another_package_is_touched():
    """Beyond imports: no `module._name` on a module of another package (Prefect, multiprocessing, asyncio, torch,
    ...), and no private attribute set by name (as `_is_subflow_tracking_task` was)."""
    offenders = []
    for directory in PROJECT_DIRS:
        for path in sorted((REPO / directory).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            modules = set()  # names bound to another package's modules
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                                if alias.name.split(".")[0] not in OWN_PACKAGES}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                        node.module.split(".")[0] not in OWN_PACKAGES:
                    modules |= {alias.asname or alias.name for alias in node.names}
            relative = str(path.relative_to(REPO))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                        and isinstance(node.value, ast.Name) and node.value.id in modules \
                        and (relative, node.value.id, node.attr) not in ALLOWED_PRIVATE and node.attr != "_exit":
                    offenders.append(f"{relative}:{node.lineno}: {node.value.id}.{node.attr}")
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "getattr") and \
                        len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and \
                        str(node.args[1].value).startswith("_") and not str(node.args[1].value).startswith("__") \
                        and (relative, node.args[1].value) not in ALLOWED_BY_NAME:
                    offenders.append(f"{relative}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    assert not offenders, offenders


def test_the_installed_prefect_is_within_the_pinned_range():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    import prefect

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [Requirement(d) for d in dependencies if Requirement(d).name == "prefect"]
    assert Version(prefect.__version__) in pin.specifier, (prefect.__version__, str(pin))
    assert not any(s.operator == "==" for s in pin.specifier), f"a range, not one release: {pin}"
    # the release CI installs (constraints.txt) is the one tested here, or the range's floor, tested too
    (floor,) = [s.version for s in pin.specifier if s.operator == ">="]
    constraints = (REPO / "constraints.txt").read_text().splitlines()
    assert f"prefect=={prefect.__version__}" in constraints or prefect.__version__ == floor, (
        prefect.__version__, floor)


def _parameters(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_the_calls_the_project_makes_keep_their_parameters():
    from prefect import flow
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.deployments.runner import RunnerDeployment
    from prefect.flow_engine import run_flow
    from prefect.flows import Flow
    from prefect.runner import Runner
    from prefect.server.api.server import create_app
    from prefect.settings import temporary_settings
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect.types.entrypoint import EntrypointType

    assert {"on_crashed", "on_cancellation", "persist_result", "result_serializer", "flow_run_name"} <= _parameters(flow)
    assert {"name", "parameters", "cron", "interval", "description", "entrypoint_type"} <= _parameters(
        Flow.to_deployment)
    assert EntrypointType.MODULE_PATH.value == "module_path"
    assert {"work_pool_name", "work_queue_name"} <= set(RunnerDeployment.model_fields)
    assert {"pause_on_shutdown", "query_seconds"} <= _parameters(Runner)
    assert _parameters(Runner.add_deployment) == {"self", "deployment"}
    assert {"task", "flow_run_id", "dynamic_key", "name", "state", "task_inputs"} <= _parameters(
        SyncPrefectClient.create_task_run)
    assert {"flow", "name", "parameters", "tags", "parent_task_run_id"} <= _parameters(
        SyncPrefectClient.create_flow_run)
    assert {"flow", "flow_run"} <= _parameters(run_flow) and "flow_run_id" in _parameters(
        SyncPrefectClient.read_flow_run)
    assert {"ephemeral", "final"} <= _parameters(create_app)
    assert "updates" in _parameters(temporary_settings) and "max_workers" in _parameters(ThreadPoolTaskRunner)
    # a run's table and curves artifacts are updated in place (flows/artifacts.py), as Prefect's own
    # update_progress_artifact does
    from prefect.client.schemas.actions import ArtifactUpdate

    assert {"artifact_id", "artifact"} <= _parameters(SyncPrefectClient.update_artifact)
    assert {"data", "description"} <= set(ArtifactUpdate.model_fields)


def test_the_flows_carry_the_stop_hooks():
    from flows import overlap
    from flows.sweep import sweep
    from flows.train import train

    for hooks in ("on_crashed_hooks", "on_cancellation_hooks"):
        assert overlap.stop_what_the_process_started in getattr(train, hooks)
        assert len(getattr(sweep, hooks)) == 1
    # Prefect calls a state hook as hook(flow, flow_run, state)
    assert list(inspect.signature(overlap.stop_what_the_process_started).parameters) == ["flow", "flow_run", "state"]


def test_a_served_deployment_names_its_flow_by_module_path():
    from prefect.types.entrypoint import EntrypointType

    from flows.train import train

    deployment = train.to_deployment(name="surface", entrypoint_type=EntrypointType.MODULE_PATH)
    assert deployment.entrypoint == "flows.train.train"


def test_every_parameter_of_a_served_flow_is_described_on_its_deployment_form():
    """The UI's Run form shows each parameter's description: Prefect reads it from the flow's docstring (its
    Args section); a parameter without one is a bare field a person has to guess."""
    from flows.serve import deployments, line_deployments

    served = deployments("configs/tiny_cpu.yaml", [], None, None)
    served += line_deployments("configs/recurring_cpu.yaml", [f"dataset.path={REPO}"])
    for flow, arguments in served:
        properties = flow.parameters.properties  # the schema a deployment of the flow sends the API
        assert properties and all(p.get("description", "").strip() for p in properties.values()), (
            flow.name, {name: p.get("description") for name, p in properties.items()})
        assert arguments["description"]


def test_multiprocessing_forkserver_surface():
    import multiprocessing
    from multiprocessing import forkserver

    assert "ensure_running" in forkserver.__all__ and _parameters(forkserver.ensure_running) == set()
    context = multiprocessing.get_context("forkserver")
    assert callable(context.set_forkserver_preload) and callable(context.Process)


IN_A_FLOW_RUN = r"""
import os, signal, sys
from prefect import flow
from prefect.exceptions import TerminationSignal

before = signal.getsignal(signal.SIGTERM)

def record(flow, flow_run, state):
    with open(sys.argv[1], "a") as out:
        out.write(f"hook {state.type.value}\n")

@flow(on_crashed=[record])
def probe(action: str):
    handler = signal.getsignal(signal.SIGTERM)
    if action == "chain":
        try:
            handler(signal.SIGTERM, None)
        except TerminationSignal as raised:
            with open(sys.argv[1], "a") as out:
                out.write(f"raised {raised.signal == signal.SIGTERM} {handler is not before}\n")
        return
    os.kill(os.getpid(), signal.SIGTERM)

probe(sys.argv[2])
with open(sys.argv[1], "a") as out:
    out.write(f"restored {signal.getsignal(signal.SIGTERM) is before}\n")
"""


def test_sigterm_in_a_flow_run_is_prefects_terminationsignal_and_ends_it_crashed(prefect_api, tmp_path):
    """What the project's stop handling relies on (flows/overlap.py): during a flow run SIGTERM's handler is
    Prefect's, a callable that raises TerminationSignal carrying the signal (the project's handler calls it after
    its own), the handler before the run is back after it; a run that SIGTERM interrupts ends Crashed and its
    on_crashed hook runs, in the process, before the process ends by the signal."""
    outcomes = {}
    for action in ("chain", "kill"):
        record = tmp_path / f"{action}.txt"
        done = subprocess.run([sys.executable, "-c", IN_A_FLOW_RUN, str(record), action], cwd=REPO, timeout=300,
                              env={**os.environ, "PREFECT_API_URL": prefect_api}, capture_output=True, text=True)
        outcomes[action] = (done.returncode, record.read_text().split("\n") if record.exists() else done.stderr)
    assert outcomes["chain"] == (0, ["raised True True", "restored True", ""]), outcomes
    assert outcomes["kill"] == (-signal.SIGTERM, ["hook CRASHED", ""]), outcomes


def test_the_attention_implementation_is_read_where_transformers_keeps_it(tiny_model_dir):
    """The one private name of transformers the trainer reads (areal_pipeline/training/engine.py): a release that
    moves it makes the reader fall back to "sdpa", which this catches."""
    from transformers import AutoModelForCausalLM

    from areal_pipeline.training.engine import attention_implementation

    for implementation in ("eager", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=implementation)
        assert attention_implementation(model) == implementation


A_CREATED_FLOW_RUN = """
import contextlib, json, os, sys
from prefect import flow, get_client
from flows.created_runs import environment_for, run_created_flow_run

@flow(name="double")
def double(x: int) -> int:
    return 2 * x

with get_client(sync_client=True) as client:
    created = client.create_flow_run(double, name="created-elsewhere", parameters={"x": 21})
os.environ.update(environment_for(created.id))
seen = []

@contextlib.contextmanager
def around(parameters):
    seen.append(parameters)
    yield

result = run_created_flow_run(double, around=around)
with get_client(sync_client=True) as client:
    ended = client.read_flow_run(created.id)
print(json.dumps({"result": result, "seen": seen, "state": ended.state.type.value, "name": ended.name,
                  "same": str(ended.id) == str(created.id)}))
"""


def test_a_flow_run_created_through_the_api_runs_in_a_process_of_its_own(prefect_api):
    """The sweep's runs (flows/created_runs.py, the one place that calls Prefect's engine entry point): the run the
    client created is the one that runs, with its parameters, and ends Completed in the API."""
    done = subprocess.run([sys.executable, "-c", A_CREATED_FLOW_RUN], cwd=REPO, timeout=300, capture_output=True,
                          text=True, env={**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome == {"result": 42, "seen": [{"x": 21}], "state": "COMPLETED", "name": "created-elsewhere",
                       "same": True}
