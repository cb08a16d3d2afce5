"""areal-pipeline: AReaL-style RL for LLM agents, orchestrated as Prefect DAG runs.

This package is the library: it never imports Prefect (that lives in `tasks/` and `flows/`).
"""

__version__ = "0.1.0"
