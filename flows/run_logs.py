"""What of Prefect's own records reaches a run's logs in the API (the UI's Logs tab).

Prefect's task engine logs "Finished in state Completed()" (or "Cached(...)") at INFO for every task run: with a
task run per node they were most of a run's log records. They are kept from the API; a node that failed
("Finished in state Failed(...)", ERROR), its retries ("Task run failed with exception ... - Retry 1/2", INFO) and
every other record still reach it. The console (`--verbose`) and the run's log file still get every record.
Prefect's level for its `prefect.task_runs` logger is left alone: a level would drop the retry messages too.
"""

from __future__ import annotations

import logging

TASK_RUN_LOGGER = "prefect.task_runs"  # the task engine's logger, as Prefect's logging.yml names it


class CompletedTaskRunsUnsent(logging.Filter):
    """On Prefect's API handler, which its flow-run, task-run and extra loggers share: only the task engine's
    records go."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.name != TASK_RUN_LOGGER or record.levelno >= logging.WARNING
                or not str(record.msg).startswith("Finished in state "))


def keep_completed_task_runs_from_the_api() -> None:
    """Filter the API handlers of the task engine's logger (idempotent). Prefect configures its logging when it is
    first imported and only adjusts levels afterwards, so the handlers found here are the ones records go to."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import APILogHandler

    ensure_logging_setup()
    for handler in logging.getLogger(TASK_RUN_LOGGER).handlers:
        if isinstance(handler, APILogHandler) and not any(isinstance(f, CompletedTaskRunsUnsent)
                                                          for f in handler.filters):
            handler.addFilter(CompletedTaskRunsUnsent())
