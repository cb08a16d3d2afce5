"""The steps of one RL iteration, in order, with what each takes from the steps before it: the one place that
says so. The Prefect tasks (tasks/nodes.py), the iteration flow (flows/train.py), its overlap with the next
iteration (flows/overlap.py) and the plain loop (`Pipeline.run_iterations`) all read this table.

    episodes = rollout(k)                              policy k - 1's episodes -> rollout shards
    ref      = ref_logprobs(k, episodes)               the reference model's logprobs   (only with ppo.kl_ctl > 0)
    batch    = advantages(k, episodes, ref)            rewards (- KL), advantages -> batch shards
    prox     = proximal_logprobs(k, batch)             policy k - 1's logprobs of the batch (only where the loss
                                                       reads them and the update has several minibatches)
    update   = ppo_update(k, batch, prox)              trainer: version k - 1 -> k
    served   = broadcast_weights(k, update)            servers: version k
    checkpoint(k, served)                              every save_freq iterations and the last
    evaluate(k, served)                                every eval_freq iterations and the last

A step's inputs are the outputs (small JSON records naming the files) of the steps it names; an input whose
step is not due this iteration is None. Where the loss reads the proximal policy's logprobs and the update is a
single minibatch, they are the update's own forward pass (its weights are still version k - 1): no step of
their own, as in the trainer.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

HOUR = 3600


@dataclass(frozen=True)
class Step:
    name: str
    doc: str
    inputs: tuple[str, ...]  # the steps whose outputs it takes, in this order, after k
    retries: int
    retry_delay_seconds: Any
    limit_s: float
    # asynchronous mode (eta > 0): it may run while the previous iteration's update runs (it needs no new weights)
    ahead: bool = False
    # where its output lives, (run paths, k) -> path: what caches it (None: the step is cheap and runs every time)
    output: Optional[Callable[[Any, int], Path]] = None
    # whether iteration k runs it, (pipeline, k) -> bool (None: always)
    when: Optional[Callable[[Any, int], bool]] = None


def ref_logprobs_path(paths, k: int) -> Path:
    return paths.iteration(k) / "ref_logprobs.parquet"


def proximal_logprobs_path(paths, k: int) -> Path:
    return paths.iteration(k) / "prox_logprobs.parquet"


STEPS = (
    Step("rollout", "Episodes of iteration k with policy k - 1 -> `iter_<k>/rollout/`. A server that died is "
         "restarted and brought to the right weights before the episodes start.", (),
         retries=2, retry_delay_seconds=[5, 30], limit_s=4 * HOUR, ahead=True, output=lambda p, k: p.rollout(k)),
    Step("ref_logprobs", "The frozen reference model's logprobs of the rollout's tokens -> "
         "`iter_<k>/ref_logprobs.parquet` (the KL penalty's reference), when ppo.kl_ctl > 0.", ("rollout",),
         retries=1, retry_delay_seconds=5, limit_s=HOUR, ahead=True, output=ref_logprobs_path,
         when=lambda pipeline, k: pipeline.cfg.ppo.kl_ctl != 0),
    Step("advantages", "Rollout shards (and reference logprobs) -> batch shards with rewards, KL penalties and "
         "advantages.", ("rollout", "ref_logprobs"),
         retries=1, retry_delay_seconds=5, limit_s=HOUR, ahead=True, output=lambda p, k: p.batch(k)),
    Step("proximal_logprobs", "Policy k - 1's logprobs of the batch -> `iter_<k>/prox_logprobs.parquet`, the "
         "proximal policy of the decoupled loss (or the recomputed old logprobs), where the update has several "
         "minibatches.", ("advantages",),
         retries=1, retry_delay_seconds=5, limit_s=HOUR, output=proximal_logprobs_path,
         when=lambda pipeline, k: bool(pipeline.proximal_columns)),
    Step("ppo_update", "Trainer version k - 1 -> k. On a retry (or a restarted trainer) the trainer is first "
         "brought back to version k - 1 from the newest checkpoint plus replayed updates.",
         ("advantages", "proximal_logprobs"),
         retries=1, retry_delay_seconds=5, limit_s=4 * HOUR, output=lambda p, k: p.update(k)),
    Step("broadcast_weights", "Pause the servers, push version k (disk or distributed), continue. Idempotent: a "
         "retry re-pushes only to servers not yet at version k.", ("ppo_update",),
         retries=2, retry_delay_seconds=[5, 30], limit_s=HOUR),
    Step("checkpoint", "`checkpoints/step_<k>/` every save_freq iterations (temp dir, then rename); keeps the "
         "newest K.", ("broadcast_weights",), retries=1, retry_delay_seconds=5, limit_s=HOUR,
         when=lambda pipeline, k: pipeline.wants_checkpoint(k)),
    Step("evaluate", "pass@1 of version k on the test split, every eval_freq iterations.", ("broadcast_weights",),
         retries=1, retry_delay_seconds=5, limit_s=4 * HOUR, output=lambda p, k: p.evaluation(k),
         when=lambda pipeline, k: pipeline.wants_evaluation(k)),
)
BY_NAME = {step.name: step for step in STEPS}
# The step during which the next iteration's flow run may start its bookkeeping: the longest one.
LONGEST = "ppo_update"


def due_steps(pipeline, k: int) -> list[Step]:
    """The steps iteration k runs, in order."""
    return [step for step in STEPS if step.when is None or step.when(pipeline, k)]


def run_steps(call: Callable[[Step, tuple], Any], steps: list[Step],
              outputs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Run `steps` in order, `call(step, inputs)` each, `inputs` the outputs of the steps it names (None for one
    not run); returns every output by step name (`outputs` holds those of steps run before, and is added to)."""
    outputs = {} if outputs is None else outputs
    for step in steps:
        outputs[step.name] = call(step, tuple(outputs.get(name) for name in step.inputs))
    return outputs


def timed(step):
    """A step of `Pipeline`: how long its library work took (`step_seconds[k][name]`, apart from any orchestration
    around it); a failure makes the pipeline ask its services again before it believes them (`Services.distrust`)."""
    @functools.wraps(step)
    def run(self, k: int, *args, **kwargs):
        started = time.perf_counter()
        try:
            return step(self, k, *args, **kwargs)
        except BaseException:
            self.services.distrust()
            raise
        finally:
            self.step_seconds.setdefault(k, {})[step.__name__] = time.perf_counter() - started
    return run
