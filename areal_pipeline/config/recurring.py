"""The configuration's section of recurring training (`recurring`, docs/recurring.md): a line of champions, each
firing training a candidate from the champion on the rows that arrived since, gated against it on held-out prompts,
approved and promoted to the servers the line serves. Part of the schema (schema.py), with each field's
documentation beside it (its rules: config/rules.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LineServeConfig:
    """Where a line's champion is served: every promotion and rollback loads the champion's weights there (without
    dropping the requests in flight) and checks with the weight probe that the servers compute with them."""

    # Servers already running that serve the champion, as host:port (the project's server, vLLM's or SGLang's,
    # speaking `backend`); they load the champion from its path on disk, so a server on another host needs the
    # line's directory on a shared file system at the same path
    addresses: list[str] = field(default_factory=list)
    backend: str = ""  # their protocol: cpu (the project's server) | vllm | sglang; empty: inference.backend
    # Servers `areal-pipeline serve --recurring` starts for the line itself (inference.backend, on the champion),
    # for as long as it serves; firings find them in the line's directory (servers.json)
    num_servers: int = 0
    host: str = "127.0.0.1"  # the address the line's own servers listen on
    base_port: int = 0  # the line's own servers' first port (the next ones follow); 0: free ports



@dataclass
class RecurringConfig:
    """A line of champions (`areal-pipeline recurring ...`, docs/recurring.md). `dataset.path` is a directory where
    files of rows (JSON lines or Parquet, the data set's own row format) arrive over time; each firing trains on
    the rows of the files that are new since the line's last firing."""

    line: str = ""  # the line's name: its directory <output_dir>/lines/<line>, its deployment; empty: run_id
    # RL iterations a candidate trains; 0: one pass over the firing's rows (their count / rollout.batch_size,
    # rounded up)
    iterations: int = 0
    max_rows: int = 0  # new rows one firing takes at most (whole files, oldest first; the rest wait); 0: all
    # Share of a firing's training rows drawn from rows earlier firings used, against forgetting (0: none)
    replay_fraction: float = 0.0
    # The held-out prompts of the gate, never trained on: a split of the data set's own source ("test": the
    # generated arithmetic test split) or a JSON lines or Parquet file of rows
    gate_split: str = "test"
    gate_max_prompts: int = 0  # the gate's first N prompts only; 0: all
    # How the gate decides: bootstrap (a paired bootstrap of the mean reward's difference over the prompts) or
    # mcnemar (McNemar's exact test on pass@1, a reward >= 1 counting as a pass)
    gate_test: str = "bootstrap"
    # The candidate must beat the champion by at least this much (mean reward, or pass@1 with mcnemar) ...
    min_improvement: float = 0.0
    confidence: float = 0.95  # ... at this confidence (one-sided p-value <= 1 - confidence)
    gate_resamples: int = 10000  # bootstrap: resamples of the prompts (seeded: a rerun decides the same)
    # auto: the gate decides | manual: a candidate that passes the gate waits for a person's answer in the Prefect
    # UI (a form on the firing's approval run; `areal-pipeline recurring approve` answers it from a shell)
    approval: str = "auto"
    approval_timeout: float = 86400.0  # seconds a manual approval may wait; no answer by then rejects
    # seconds a firing waits for the line's previous firing, still running, to end; then it fails, naming it
    wait_timeout: float = 86400.0
    serve: LineServeConfig = field(default_factory=LineServeConfig)  # where the champion is served
