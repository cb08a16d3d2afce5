"""Putting a line's champion on the servers it serves: each loads the champion's weights from disk, without
dropping the requests in flight (no pause, nothing aborted: the project's server swaps the weights between two
decode steps, SGLang after the running requests, vLLM's reload in its engine loop), and the probe then checks that
every server computes with them: its logprobs of the weight probe against those the gate's own server gave for
the same checkpoint (gate_eval.py). A server that fails either step fails the publication, naming it; the servers
that took the new weights are then given the previous ones back, so that a failed promotion leaves every server
serving what it served before."""

from __future__ import annotations

import copy
from typing import Any, Optional

from areal_pipeline.config import ExperimentConfig
from areal_pipeline.utils import get_logger, run_async

logger = get_logger(__name__)


class PublishError(RuntimeError):
    pass


def serving_inference(cfg: ExperimentConfig):
    """The inference settings the line's servers are spoken to with: the line's, in their backend's protocol."""
    inference = copy.deepcopy(cfg.inference)
    inference.backend = cfg.recurring.serve.backend or inference.backend
    return inference


def publish(cfg: ExperimentConfig, addresses: list[str], model_dir: str, version: int,
            expected_probe: Optional[list[float]], previous: Optional[tuple[str, int]] = None) -> dict[str, Any]:
    """Load `model_dir` as `version` on every server at `addresses` and verify it with the probe (`expected_probe`:
    the gate's logprobs of it; None: not verified, said in the record). On a failure the servers are given
    `previous` (model directory, version) back and PublishError is raised."""
    from areal_pipeline.inference.backend import engine_for
    from areal_pipeline.inference.weight_check import probe_ids, served_dtype, tolerance, verify_served
    from areal_pipeline.model import load_tokenizer

    if not addresses:
        return {"addresses": [], "model": model_dir, "version": version, "verified": False}
    inference = serving_inference(cfg)
    probe = probe_ids(load_tokenizer(model_dir, cfg.model.trust_remote_code))
    # the expected logprobs came from the gate's servers, the line's inference settings: where they computed in
    # float32, the tight tolerance applies (if the line's servers do too)
    tol = tolerance(inference, trainer_fp32=served_dtype(cfg.inference) == "float32")

    async def push(path: str, v: int, check: Optional[list[float]]) -> dict[str, float]:
        async with engine_for(addresses, inference) as engine:
            await engine.update_weights_from_disk(path, v)
            if check is None:
                return {}
            return await verify_served(engine, probe, check, v, tol, backend=inference.backend)

    try:
        report = run_async(push(model_dir, version, expected_probe))
    except Exception as error:
        if previous is not None:
            try:
                run_async(push(previous[0], previous[1], None))
                logger.warning("publishing version %d failed; the servers were given version %d back", version,
                               previous[1])
            except Exception as restore_error:  # the error that matters is the publication's
                logger.error("publishing version %d failed, and giving the servers version %d back failed too: %s",
                             version, previous[1], restore_error)
        raise PublishError(f"the line's servers ({', '.join(addresses)}) did not take version {version} "
                           f"({model_dir}): {error}") from error
    return {"addresses": list(addresses), "model": model_dir, "version": version, "verified": expected_probe is not None,
            "probe_difference": report, "tolerance": tol}
