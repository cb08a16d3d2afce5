"""A recurring line (docs/recurring.md): where its files live, and the steps of a firing that the `recurring` flow
calls in order, each idempotent (its output on disk is found and handed back on a resume):

    collect     the rows new since the line's last firing (incoming.py) -> firings/<n>/data/{train,test}.jsonl
    candidate   the candidate's config: the line's, on the firing's rows, from the champion (a branch of the
                champion's run at its iteration; the first firing trains the base model afresh)
    gate        champion and candidate on the gate's prompts (gate_eval.py, gate.py) -> firings/<n>/gate.json
    enshrine    the candidate's checkpoint hard-linked into champions/<n>/ and verified: what the ledger names
    publish     the champion's weights on the servers the line serves, verified by the probe (publish.py)

    <output_dir>/lines/<line>/
        ledger.json  ledger.prev.json  .lock
        firings/0001/  data/ data.json candidate.yaml gate.json approval.json logs/
        champions/0001/  (a checkpoint: model/, optimizer.safetensors, trainer_state.json, checksums.json)
        servers.json  (the servers `serve --recurring` runs for the line)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Optional

from areal_pipeline.checksums import has_checksums, verify_checksums
from areal_pipeline.config import ConfigError, ExperimentConfig, save_config
from areal_pipeline.recurring.incoming import (Window, check_dataset_reads_rows, gate_rows, iterations_for,
                                               take_window, write_rows)
from areal_pipeline.recurring.traffic import collect_traffic, place_traffic, traffic_rows
from areal_pipeline.recurring.ledger import Ledger, line_lock
from areal_pipeline.run_dir import RunPaths, pin_checkpoint, read_json, write_json
from areal_pipeline.utils import atomic_directory, get_logger, link_tree

logger = get_logger(__name__)

def line_name(cfg: ExperimentConfig) -> str:
    return cfg.recurring.line or cfg.run_id


def check_line_config(cfg: ExperimentConfig) -> None:
    """What a line needs of its config, beyond the config's own rules: ConfigError naming the key."""
    problem = check_dataset_reads_rows(cfg.dataset)
    if problem:
        raise ConfigError(problem)
    if cfg.recurring.approval == "manual":
        import os

        if not os.environ.get("PREFECT_API_URL"):
            raise ConfigError("recurring.approval=manual: the approver answers through a Prefect server the firing "
                              "reports to; set PREFECT_API_URL (e.g. `areal-pipeline prefect-server start`)")


class Line:
    def __init__(self, cfg: ExperimentConfig, config_path: Optional[str] = None):
        self.cfg = cfg
        self.config_path = config_path  # the file it was loaded from (a resumed firing reloads it)
        self.name = line_name(cfg)
        self.dir = Path(cfg.output_dir) / "lines" / self.name

    # ----- where things are ------------------------------------------------------------------------
    @property
    def ledger_path(self) -> Path:
        return self.dir / "ledger.json"

    def firing_dir(self, firing_id: int) -> Path:
        return self.dir / "firings" / f"{firing_id:04d}"

    def champion_dir(self, firing_id: int) -> Path:
        return self.dir / "champions" / f"{firing_id:04d}"

    def candidate_run_id(self, firing_id: int) -> str:
        return f"{self.name}-{firing_id:04d}"

    def run_dir(self, run_id: str) -> Path:
        return Path(self.cfg.output_dir) / run_id

    # ----- the ledger ------------------------------------------------------------------------------
    def read_ledger(self) -> Optional[Ledger]:
        return Ledger.load(self.ledger_path)

    def ledger(self) -> Ledger:
        """The line's ledger, or a new one whose champion is the base model (the embedded one built if needed)."""
        ledger = self.read_ledger()
        if ledger is None:
            from areal_pipeline.model import resolve_model_path

            ledger = Ledger.new(self.ledger_path, self.name,
                                resolve_model_path(self.cfg.model, self.cfg.output_dir, self.cfg.seed))
        return ledger

    def lock(self, on_wait: Optional[Callable[[str], None]] = None):
        return line_lock(self.dir, self.cfg.recurring.wait_timeout, on_wait)

    def champion_model(self, ledger: Ledger, champion: Optional[dict[str, Any]] = "current") -> tuple[str, int]:
        """(model directory, policy version) of `champion` (default: the line's; None: the base model)."""
        champion = ledger.champion if champion == "current" else champion
        if champion is None:
            return ledger.data["base_model"], 0
        return champion["model"], int(champion["iteration"])

    # ----- collect ---------------------------------------------------------------------------------
    def collect(self, ledger: Ledger, firing: dict[str, Any]) -> dict[str, Any]:
        """The firing's rows, written once (a resumed firing finds them): the new files' rows and those replayed as
        `data/train.jsonl`, the gate's as `data/test.jsonl`; `data.json` records the window (written last)."""
        out = self.firing_dir(firing["id"])
        record = read_json(out / "data.json")
        if record is not None:
            return record
        gate = gate_rows(self.cfg)
        gate_questions = {str(row.get("question", "")).strip() for row in gate}
        r = self.cfg.recurring
        if r.traffic_fraction < 1:
            window = take_window(Path(self.cfg.dataset.path).expanduser(), ledger.watermark, gate_questions,
                                 max_rows=r.max_rows, replay_fraction=r.replay_fraction,
                                 seed=self.cfg.seed * 100003 + firing["id"])
        else:  # the line trains on its traffic alone: the files wait
            window = Window([], [], [], 0, [])
        rows = window.rows + window.replay
        with atomic_directory(out / "data") as tmp:
            # a candidate of traffic alone plays no row, but its run loads a train split: the traffic's questions
            write_rows(tmp / "train.jsonl", rows or traffic_rows())
            write_rows(tmp / "test.jsonl", gate)
        iterations = iterations_for(len(rows), self.cfg.rollout.batch_size, r.iterations) if window.rows else 0
        record = {**window.record(), "gate_prompts": len(gate), "iterations": iterations,
                  "path": str((out / "data").resolve())}
        if r.traffic_fraction > 0:
            _, champion_version = self.champion_model(ledger)
            record.update(collect_traffic(self, ledger, firing, gate_questions,
                                          first=champion_version + iterations + 1, row_iterations=iterations))
            record["iterations"] = iterations + len(record["traffic_iterations"])
        return write_json(out / "data.json", record)

    # ----- the candidate ---------------------------------------------------------------------------
    def candidate_config(self, ledger: Ledger, firing: dict[str, Any], data: dict[str, Any]) -> ExperimentConfig:
        """The line's config, as the candidate's run: its own run id, the firing's rows, and its length after the
        champion's iteration (the learning-rate schedule goes on from the champion's position: it spans
        trainer.optimizer.schedule_iterations of the line's lineage)."""
        cfg = copy.deepcopy(self.cfg)
        cfg.run_id = self.candidate_run_id(firing["id"])
        cfg.dataset.path = data["path"]
        _, start = self.champion_model(ledger)
        cfg.total_iterations = start + data["iterations"]
        if data.get("traffic_iterations"):  # episodes other policies sampled: weighed by the decoupled loss
            cfg.ppo.use_decoupled_loss = True
        return cfg

    def place_traffic(self, firing: dict[str, Any], cfg: ExperimentConfig) -> None:
        """The firing's traffic episodes as the candidate run's rollouts of their iterations (copies)."""
        place_traffic(self.firing_dir(firing["id"]), read_json(self.firing_dir(firing["id"]) / "data.json"), cfg)

    def save_candidate_config(self, firing: dict[str, Any], cfg: ExperimentConfig) -> Path:
        """The first firing's candidate config, written once: a resumed firing trains its run under the config it
        started with, whatever the line's file says since."""
        path = self.firing_dir(firing["id"]) / "candidate.yaml"
        if not path.is_file():
            save_config(cfg, path)
        return path

    def candidate_model(self, firing: dict[str, Any], cfg: ExperimentConfig) -> str:
        """The candidate's final checkpoint's model directory, checked against its checksums."""
        checkpoint = RunPaths(cfg.run_dir).checkpoint(cfg.total_iterations)
        verify_checksums(checkpoint, under="model")
        return str((checkpoint / "model").resolve())

    # ----- enshrine --------------------------------------------------------------------------------
    def enshrine(self, firing: dict[str, Any], run_id: str, iteration: int, gate: dict[str, Any]) -> dict[str, Any]:
        """The champion record of run `run_id`'s checkpoint at `iteration`: the line's own copy of it (hard links
        under champions/<firing>/, verified), and the step pinned in the run so that its pruning passes it by."""
        source = RunPaths(self.run_dir(run_id)).checkpoint(iteration)
        target = self.champion_dir(firing["id"])
        if not has_checksums(target / "checkpoint"):
            verify_checksums(source)
            with atomic_directory(target) as tmp:
                link_tree(source, tmp / "checkpoint")
            verify_checksums(target / "checkpoint")
        pin_checkpoint(self.run_dir(run_id), iteration)
        return {"firing": firing["id"], "run_id": run_id, "iteration": iteration,
                "checkpoint": str((target / "checkpoint").resolve()),
                "model": str((target / "checkpoint" / "model").resolve()), "source": str(source.resolve()),
                "gate": gate_summary(gate), "probe": gate.get("probe", {}).get("candidate")}

    # ----- what the line serves --------------------------------------------------------------------
    def announced_servers(self) -> list[str]:
        """The servers `serve --recurring` runs for the line (servers.json), while its process lives."""
        record = read_json(self.dir / "servers.json")
        if not record:
            return []
        import os

        try:
            os.kill(int(record["pid"]), 0)
        except (OSError, ValueError, KeyError):
            return []  # that process is gone, and its servers with it
        return list(record.get("addresses", []))

    def served_addresses(self) -> list[str]:
        return [*self.cfg.recurring.serve.addresses,
                *(a for a in self.announced_servers() if a not in self.cfg.recurring.serve.addresses)]


def gate_summary(gate: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The figures of a gate record that the ledger and `status` show."""
    if not gate:
        return None
    return {key: gate.get(key) for key in ("test", "prompts", "champion", "candidate", "improvement", "p_value",
                                            "min_improvement", "confidence", "passed", "reason")}


def read_gate(line: Line, firing_id: int) -> Optional[dict[str, Any]]:
    return read_json(line.firing_dir(firing_id) / "gate.json")
