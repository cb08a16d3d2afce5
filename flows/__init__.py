"""Prefect flows: `train` (one child run per RL iteration), `evaluate`, and the deployments that serve them.

Importing this package sets Prefect defaults suited to a flow run per iteration (each can be overridden
by setting the variable): see ../shared/docs/prefect-notes.md for what each costs.
"""

import os

PREFECT_DEFAULTS = {
    # no internet here, and no reason to phone home anywhere
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    # the library's logs (servers, trainer, rollout) reach the Prefect run logs
    "PREFECT_LOGGING_EXTRA_LOGGERS": "areal_pipeline",
    # one SQLite transaction per task-run event caused 'database is locked' storms (503, then the client's
    # back-off); batching them shows task runs in the UI up to the flush interval late
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "1000",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "5",
    # Server-side settings: they only reach a server this process starts (ephemeral mode, no PREFECT_API_URL),
    # which lives as long as the run. There, matching every task-run event against automations and storing
    # every event cost its server CPU that the nodes beside it on the same cores lost (see
    # bench/orchestration_overhead.py); automations cannot be set up against such a server anyway. Task
    # runs, flow runs, logs and artifacts are recorded as before; only the Events page stays empty.
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    "PREFECT_SERVER_EVENTS_STREAM_OUT_ENABLED": "false",
    # the background rollout executor's thread logs outside any run: to the console only, without a warning
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    # the ephemeral (no server configured) API server can take tens of seconds to start on a loaded machine
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
}
for _name, _value in PREFECT_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

import logging  # noqa: E402
import sys  # noqa: E402

_library_logger = logging.getLogger("areal_pipeline")
# Prefect gives the extra logger its API handler, not a level: without one it inherits the root logger's
# (WARNING in deployment runs), and the library's INFO records would never reach the run logs.
if _library_logger.level == logging.NOTSET:
    _library_logger.setLevel(logging.INFO)
# Where something imported Prefect before this package, Prefect set up its logging before the defaults above
# existed, and the library's logger lacks the handlers PREFECT_LOGGING_EXTRA_LOGGERS gives it.
if "prefect" in sys.modules:
    for _handler in logging.getLogger("prefect.extra").handlers:
        if _handler not in _library_logger.handlers:
            _library_logger.addHandler(_handler)
