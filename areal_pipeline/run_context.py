"""What a node of a run needs besides its inputs, as a value: the run's directory and id, and the addresses of its
live services (inference servers, trainer, tool servers, the judge it serves). With it a node runs the same in the
process that owns the run, in a new process, or on a Prefect worker elsewhere: `attach(context)` builds a `Pipeline`
from the run directory's saved config (`config.yaml`) that uses those services as they are (`Services.attach`).

A step keeps nothing in the owner's pipeline that another process needs: its inputs and outputs are files, the
episode journal is on disk, the trainer's and the servers' versions are asked of them (and brought where the step
needs them), the data set is the run's prepared copy. What an attached pipeline cannot do, and what it does instead:

- start, restart or stop a service: one that does not answer fails the node with `ServiceGoneError`, naming it
  (transient: the owner restarts its services at the same addresses, so a retry then finds them);
- share the owner's trainer lock: nodes that command the trainer (ppo_update, proximal_logprobs, checkpoint, and
  any node that pushes weights) must not run in two processes at once; the train flow runs them one at a time;
- reuse the owner's weight-update group (trainer.weight_sync=distributed): it forms one of its own on its first
  push, and the owner's next push forms the owner's again;
- serve a LoRA adapter under the owner's label: it pushes the adapter of the version a step needs again;
- hold the judge's Prefect limit outside Prefect: a node that a Prefect worker runs holds it as the owner does
  (tasks/runs.py); `areal-pipeline node`, which runs without Prefect, keeps a local semaphore of
  `judge.max_concurrency` calls;
- add its step timings to the owner's metrics (`time_<step>` of metrics.jsonl counts the owner's nodes only);
- play ahead in asynchronous mode: a rollout node in a new process runs the background executor for its own
  iteration and stops it when the process ends (the journal keeps every group it played).

Paths in the saved config (data sets, trainer.weights_dir) are read as the owner read them, relative ones against the
working directory: a node elsewhere runs from the same directory, or the config names them whole. Its process needs
the run's credential (AREAL_PIPELINE_TOKEN / _FILE as the owner had it, else the output directory's token file).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

from areal_pipeline.run_dir import RunPaths
from areal_pipeline.steps import BY_NAME
from areal_pipeline.utils import deadline


@dataclass(frozen=True)
class RunContext:
    run_dir: str  # absolute
    run_id: str
    inference: tuple[str, ...]  # the inference servers' addresses
    trainer: str
    tools: tuple[tuple[str, str], ...] = ()  # (tool name, address) of the tool servers the run started
    judge: Optional[str] = None  # the judge server the run serves itself (judge.serve)

    @property
    def paths(self) -> RunPaths:
        return RunPaths(Path(self.run_dir))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "inference": list(self.inference), "tools": dict(self.tools)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunContext":
        names = {f.name for f in fields(cls)}
        missing = {"run_dir", "run_id", "inference", "trainer"} - set(data)
        unknown = set(data) - names
        if missing or unknown:
            raise ValueError(f"not a run context: {', '.join(sorted(missing))} missing" if missing else
                             f"not a run context: unknown key(s) {', '.join(sorted(unknown))}; valid: "
                             f"{', '.join(sorted(names))}")
        return cls(run_dir=str(data["run_dir"]), run_id=str(data["run_id"]), inference=tuple(data["inference"]),
                   trainer=str(data["trainer"]), tools=tuple(sorted((data.get("tools") or {}).items())),
                   judge=data.get("judge"))


def context_of(pipeline) -> RunContext:
    """The context of the run whose services `pipeline` started (all of them: call it once they are up)."""
    services = pipeline.services
    if services.trainer_client is None or not services.addresses:
        raise RuntimeError(f"run {pipeline.cfg.run_id}: its services are not started, so it has no context yet")
    return RunContext(run_dir=str(pipeline.paths.run_dir.resolve()), run_id=pipeline.cfg.run_id,
                      inference=tuple(services.addresses), trainer=services.trainer_client.address,
                      tools=tuple(sorted(services.tool_addresses.items())),
                      judge=services.judge.address if services.judge is not None else None)


def attach(context: RunContext):
    """A `Pipeline` of the run that uses its running services and never starts, restarts or stops one; `close()`
    it when done (its `services.stop()` stops nothing)."""
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_spec import load_config

    run_dir = Path(context.run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise FileNotFoundError(f"{saved}: missing; a run's directory holds the config its process saved when it "
                                "started (is the run context's run_dir the run's directory on this machine?)")
    output_dir = run_dir
    for _ in Path(context.run_id).parts:
        output_dir = output_dir.parent
    cfg = load_config(saved, [f"output_dir={output_dir}", f"run_id={context.run_id}"])
    pipeline = Pipeline(cfg)
    pipeline.services.attach(list(context.inference), context.trainer, dict(context.tools), context.judge)
    return pipeline


def run_node(pipeline, name: str, k: int, inputs: tuple) -> Any:
    """`Pipeline.<name>(k, *inputs)`, within the step's time limit: every trainer command, inference request and
    wait inside it is bounded by what is left (`utils.deadline`), and running past the limit fails the node."""
    with deadline(BY_NAME[name].limit_s, f"{name} of iteration {k}"):
        return getattr(pipeline, name)(k, *inputs)


def run_attached_node(context: RunContext, name: str, k: int, inputs: tuple) -> Any:
    """Node `name` of iteration k in this process, attached to the run's services: its output record."""
    if name not in BY_NAME:
        raise ValueError(f"no step '{name}'; the steps: {', '.join(BY_NAME)}")
    if len(inputs) > len(BY_NAME[name].inputs):
        raise ValueError(f"{name} takes the outputs of {', '.join(BY_NAME[name].inputs) or 'no step'}, in that "
                         f"order; given {len(inputs)}")
    pipeline = attach(context)
    try:
        return run_node(pipeline, name, k, tuple(inputs))
    finally:
        pipeline.close()
        pipeline.services.stop()
