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
    # Record every chat completion the line's own servers serve (prompt and completion token ids, logprobs, the
    # weight version of each token, the conversation) into <line>/traffic/, and take rewards at POST /v1/feedback
    # (docs/online.md): what firings with recurring.traffic_fraction > 0 train on. Off: nothing is kept
    record: bool = False
    record_rotate_mb: float = 64.0  # a shard of recorded traffic is sealed when its journal passes this size ...
    record_rotate_s: float = 3600.0  # ... or this age (seconds)
    # Recorded traffic older than this many days is deleted (at each server start and rotation, and by each
    # firing), trained on or not: users' prompts are data they may not want kept. 0: kept until deleted by hand
    retention_days: float = 30.0


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
    # Share of a firing's training episodes taken from the line's recorded traffic with its rewards (docs/online.md):
    # 0: the data set's rows only; 1: the traffic only (the rows wait); between: the rows' iterations, then as much
    # rewarded traffic as makes this share of the firing's episodes (the rest waits for the next firing)
    traffic_fraction: float = 0.0
    # seconds a recorded sample waits for its reward: one still without a reward when a firing starts waits for a
    # later firing; past this age it is dropped (counted as expired), never trained as a reward of 0
    feedback_window: float = 604800.0
    # a recorded sample generated more than this many policy versions before the champion is dropped (counted)
    max_staleness: int = 16
    # A function scoring recorded samples that got no feedback, when a firing collects them (a verifiable answer
    # checked later): 'module:function' or 'path/file.py:function', called as f(messages, completion) with the
    # request's messages and the reply's text, returning a reward, or None where it cannot tell yet (the sample
    # waits). Feedback, where there is some, wins. Empty: rewards come from POST /v1/feedback alone
    traffic_reward: str = ""
    # samples of the same prompt (token for token) form a group (GRPO's baseline) from this many on; the others are
    # pooled, each firing's pool one group: REINFORCE with the pool's mean reward as the baseline
    traffic_min_group: int = 2
