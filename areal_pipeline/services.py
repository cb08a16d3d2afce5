"""The long-lived processes of a run: inference servers, trainer, tool servers."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

from areal_pipeline import auth, shutdown
from areal_pipeline.config import ExperimentConfig
from areal_pipeline.errors import PermanentError
from areal_pipeline.inference.launcher import LIVENESS_PATH, LIVENESS_TIMEOUT_S, launch_servers
from areal_pipeline.processes import ServerProcess
from areal_pipeline.run_spec import assemble
from areal_pipeline.training.client import TrainerClient, TrainerError, launch_trainer
from areal_pipeline.utils import get_logger

logger = get_logger(__name__)


# What the services' forkserver imports before it forks the first of them (the model class is resolved by name at
# load time, so a model of another architecture imports its own modules in the service, as it would anyway).
FORKSERVER_PRELOAD = (
    "areal_pipeline.inference.server",
    "areal_pipeline.training.trainer_server",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen2.tokenization_qwen2",
    "transformers.tokenization_utils_fast",
)


def start_forkserver() -> None:
    """Start the forkserver that the CPU services are forked from (areal_pipeline/forkserver.py) now: it imports
    their modules while the command goes on with its own start-up."""
    from areal_pipeline import forkserver

    forkserver.start(FORKSERVER_PRELOAD)


class ServicesStoppedError(RuntimeError):
    pass


class NotOwnedError(PermanentError, RuntimeError):
    """Asked of a pipeline attached to another process's services what only their owner does (start them)."""


class ServiceGoneError(ConnectionError):
    """A service of the run that a pipeline attached to it (`Services.attach`) does not answer. Transient: the
    process that owns the service restarts it at the same address, and a retry then finds it."""


class Services:
    """The long-lived processes of a run (inference servers, trainer, tool servers), owned by the
    orchestrating process; steps find them here and restart the ones that died.

    A step asks each service over HTTP whether it is healthy only when that is in doubt: at first, and after
    any step failed (`distrust`). While every step succeeds, a running process that answered its last request
    is taken as healthy: on a short iteration a dozen loopback round trips are a noticeable share of it."""

    def __init__(self, cfg: ExperimentConfig, model_path: str, log_dir: Path, *,
                 tools: Optional[tuple[str, ...]] = None):
        self.cfg = cfg
        # the services it starts demand the run's token, and its clients send it: the output directory's if none
        # is given (auth.py)
        auth.ensure_run_token(cfg.output_dir)
        self.required_tools = tools  # the workflow's (RunSpec.tools); None: looked up from cfg when needed
        self.model_path = model_path
        self.log_dir = log_dir
        self.inference: list[ServerProcess] = []
        self.trainer: Optional[ServerProcess] = None
        self.trainer_client: Optional[TrainerClient] = None
        self.tools: dict[str, ServerProcess] = {}
        self.judge: Optional[ServerProcess] = None  # the judge the run serves itself (judge.serve)
        self._judge_lock = threading.Lock()
        # inference.addresses: servers someone else runs; used, never started, restarted or stopped
        self.external: list[str] = []
        self._placement = None
        self.stopped = False  # after stop(), nothing is started or restarted again
        self._inference_checked = self._trainer_checked = False
        # The policy version each inference server serves, as last read or pushed (None: ask them). Threads
        # read and record it; `_served_epoch` counts what made it unknown (a push, a restart, a failure), so a
        # reading that was overtaken by one of those is never recorded.
        self._served: Optional[list[Optional[int]]] = None
        self._served_epoch = 0
        self._served_lock = threading.Lock()
        # Changes whenever an inference server may have lost its weight-update group (restarted, or a step failed
        # part-way): the trainer joins the group afresh rather than send an update a server cannot take.
        self.inference_epoch = 0
        # Set by `attach`: the services of a run another process owns, used as they are and never started,
        # restarted or stopped here (None: this process owns the services it starts)
        self.attached: Optional[dict] = None
        # Ctrl-C or SIGTERM stops them at once, wherever the orchestrator's threads are
        self._on_stop_signal = shutdown.register(f"the services of run {cfg.run_id}", self.stop)

    def attach(self, inference: list[str], trainer: str, tools: dict[str, str], judge: Optional[str]) -> None:
        """Use the running services of a run that another process started (their addresses: run_context.py): each
        is asked whether it answers before its first use (and again after a failed step), and one that does not
        is an error naming it (`ServiceGoneError`), not a process started here. Their weight versions are read from
        the servers, and this process joins a weight-update group of its own (a fresh `inference_epoch`: it cannot
        know which group the owner's last push formed)."""
        import secrets

        self.attached = {"tools": dict(tools), "judge": judge}
        self.external = list(inference)
        self.trainer_client = TrainerClient(trainer, self.cfg.trainer.command_timeout)
        self.inference_epoch = secrets.randbits(31) + 1
        self.forget_served()

    def _gone(self, what: str, address: str, error: object) -> ServiceGoneError:
        return ServiceGoneError(
            f"run {self.cfg.run_id}: {what} {address} does not answer ({error}). This node runs outside the process "
            "that started the run's services: it uses them as they are and cannot start or restart them; run it "
            "again once the run's flow has them back (or in the flow's own process)")

    def _ensure_attached_inference(self) -> None:
        if self._inference_checked:
            return
        path = "/health" if self.cfg.inference.backend == "vllm" else LIVENESS_PATH
        for address in self.external:
            if not ServerProcess([], address).is_healthy(path, LIVENESS_TIMEOUT_S):
                raise self._gone("inference server", address, f"GET {path} failed")
        self._inference_checked = True

    def _ensure_attached_trainer(self) -> TrainerClient:
        if not self._trainer_checked:
            try:
                self.trainer_client.health()
            except OSError as error:
                raise self._gone("trainer", self.trainer_client.address, error) from error
            self._trainer_checked = True
        return self.trainer_client

    def _refuse_if_attached(self, what: str) -> None:
        if self.attached is not None:
            raise NotOwnedError(f"run {self.cfg.run_id}: cannot start its {what} from a pipeline attached to the run's "
                               "running services (the process that owns the run starts them)")

    def distrust(self) -> None:
        """A step failed: the next steps ask every service whether it is healthy, and what it serves."""
        self._inference_checked = self._trainer_checked = False
        self.forget_served()
        self.inference_epoch += 1
        if self.trainer_client is not None:
            self.trainer_client.forget_version()

    def forget_served(self) -> int:
        with self._served_lock:
            self._served, self._served_epoch = None, self._served_epoch + 1
            return self._served_epoch

    def known_served(self) -> tuple[int, Optional[list[Optional[int]]]]:
        with self._served_lock:
            return self._served_epoch, None if self._served is None else list(self._served)

    def record_served(self, epoch: int, versions: list[Optional[int]]) -> None:
        with self._served_lock:
            if epoch == self._served_epoch:
                self._served = list(versions)

    def _refuse_if_stopped(self) -> None:
        if self.stopped:
            raise ServicesStoppedError("the run's services were stopped (the run is ending)")

    @property
    def placement(self):
        """The GPUs of the inference servers and the trainer (areal_pipeline/placement.py), planned once."""
        if self._placement is None:
            from areal_pipeline.placement import plan

            self._placement = plan(self.cfg)
        return self._placement

    def start_inference(self) -> list[str]:
        self._refuse_if_stopped()
        self._refuse_if_attached("inference servers")
        if self.cfg.inference.addresses:
            if not self.external:
                self._check_external(self.cfg.inference.addresses)
                # Their weight_version says nothing of whose weights they hold: the first sync pushes the trainer's.
                self.record_served(self.forget_served(), [None] * len(self.cfg.inference.addresses))
                self.external = list(self.cfg.inference.addresses)
        elif not self.inference:
            placement = self.placement
            self.inference = launch_servers(self.model_path, self.cfg.inference, self.cfg.seed, self.log_dir,
                                            gpus=list(placement.servers), colocated=bool(placement.shared),
                                            experiment=self.cfg)
        return self.addresses

    def _check_external(self, addresses: list[str]) -> None:
        """Each server answers /health within inference.setup_timeout (one still loading its model is waited for);
        else an error naming the ones that do not."""
        import time

        from areal_pipeline.processes import ServerLaunchError

        probes = [ServerProcess([], address, kind="inference server (inference.addresses)") for address in addresses]
        deadline = time.monotonic() + self.cfg.inference.setup_timeout
        # beyond SGLang's own health-check timeout (20 s): a server paused by another client answers 503, not nothing
        while pending := [p for p in probes if not p.is_healthy(timeout=LIVENESS_TIMEOUT_S)]:
            if time.monotonic() >= deadline:
                raise ServerLaunchError(
                    f"inference server(s) {', '.join(p.address for p in pending)} (inference.addresses) did not "
                    f"answer GET /health with 200 within {self.cfg.inference.setup_timeout:.0f}s: start them first, "
                    "or check the addresses")
            time.sleep(0.5)
        logger.info("using running inference servers %s (not started or stopped by this run)", ", ".join(addresses))

    def start_trainer(self) -> str:
        self._refuse_if_stopped()
        self._refuse_if_attached("trainer")
        if self.cfg.trainer.address:  # on nodes of its own (training/nodes.py): found, never started or stopped
            if self.trainer_client is None:
                from areal_pipeline.training.nodes import connect_trainer

                self.trainer_client = connect_trainer(self.cfg)
            return self.trainer_client.address
        if self.trainer is None:
            self.trainer, self.trainer_client = launch_trainer(self.cfg, self.model_path, self.log_dir,
                                                               gpus=self.placement.trainer)
        return self.trainer.address

    def start_tools(self) -> dict[str, str]:
        """Start the tool servers the run's workflow declares (its `tools`); name -> address of those started. A
        tool whose config names a server already running is checked instead (the workflow uses that one)."""
        from areal_pipeline.tools import tool_server_starter

        self._refuse_if_stopped()
        self._refuse_if_attached("tool servers")
        if self.required_tools is None:
            self.required_tools = assemble(self.cfg).tools
        for name in self.required_tools:
            if name not in self.tools:
                process = tool_server_starter(name, self.cfg.rollout.workflow)(self.cfg, self.log_dir)
                if process is not None:
                    self.tools[name] = process
        started = {name: p.address for name, p in self.tools.items()}
        judge = self.start_judge()
        return {**started, "judge": judge} if judge else started

    def start_judge(self) -> Optional[str]:
        """The address of the judge server the run serves itself (`judge.serve`, rewards/local_judge.py), started
        where it is not running (again at the same address where it died); None where the run serves none."""
        if self.cfg.rollout.group_reward != "judge" or not self.cfg.judge.serve:
            return None
        if self.attached is not None:
            if self.attached["judge"] is None:
                raise NotOwnedError(f"run {self.cfg.run_id} serves its own judge (judge.serve), but the run context "
                                   "this pipeline was attached with names none")
            return self.attached["judge"]
        from areal_pipeline.rewards.local_judge import start_judge_server

        with self._judge_lock:
            self._refuse_if_stopped()
            if self.judge is not None and self.judge.popen is not None and self.judge.popen.poll() is not None:
                logger.warning("the judge server %s exited with code %s: starting it again", self.judge.address,
                               self.judge.popen.returncode)
                dead, self.judge = self.judge, None
                dead.stop()
                self.judge = start_judge_server(self.cfg, self.log_dir, address=dead.address)
            elif self.judge is None:
                self.judge = start_judge_server(self.cfg, self.log_dir)
            return self.judge.address

    @property
    def addresses(self) -> list[str]:
        return list(self.external) if self.external else [s.address for s in self.inference]

    @property
    def tool_addresses(self) -> dict[str, str]:
        """The run's tool servers, name -> address."""
        if self.attached is not None:
            return dict(self.attached["tools"])
        return {name: p.address for name, p in self.tools.items()}

    def ensure_inference_alive(self) -> None:
        """Restart servers that died (they come back at version 0; the next step pushes the weights)."""
        self._refuse_if_stopped()
        if self.attached is not None:
            return self._ensure_attached_inference()
        # Not /health: a server this run paused (an update in flight on another thread) would block on it and look
        # dead to SGLang's probe after ~20 s; liveness is asked where a paused server answers too.
        dead = [s for s in self.inference if s.popen is None or s.popen.poll() is not None
                or not (self._inference_checked or s.is_healthy(s.liveness_path, LIVENESS_TIMEOUT_S))]
        self._inference_checked = True
        if dead:
            self.forget_served()
            self.inference_epoch += 1  # a restarted server holds no weight-update group: the next push joins afresh
            logger.warning("inference server(s) %s died; restarting", ", ".join(s.address for s in dead))
            for s in dead:
                s.stop()
            self.inference = [s for s in self.inference if s not in dead]
            # restart on the same ports, so that addresses recorded elsewhere stay valid
            self.inference += [ServerProcess(s.command, s.address, s.log_path, s.env, s.fork, s.kind,
                                             s.liveness_path).start() for s in dead]
            for s in self.inference[-len(dead):]:
                s.wait_healthy(self.cfg.inference.setup_timeout)

    def ensure_trainer_alive(self) -> TrainerClient:
        self._refuse_if_stopped()
        if self.attached is not None:
            return self._ensure_attached_trainer()
        if self.cfg.trainer.address:
            return self._ensure_remote_trainer()
        if self.trainer is not None and self.trainer.popen.poll() is None and (
                self._trainer_checked or self.trainer.is_healthy()):
            self._trainer_checked = True
            return self.trainer_client
        logger.warning("the trainer is down; restarting it")
        if self.trainer is not None:
            self.trainer.stop()
        self.trainer = self.trainer_client = None
        self.start_trainer()
        return self.trainer_client

    def _ensure_remote_trainer(self) -> TrainerClient:
        """The trainer on its own nodes answers, or is waited for (trainer.setup_timeout) while its scheduler
        restarts a lost node: new ranks come back uninitialised, and the run restores their version."""
        client = self.trainer_client
        if client is not None and not self._trainer_checked:
            try:
                if not client.health().get("initialized"):  # its ranks were restarted: the model is loaded again
                    client.call("initialize")
            except (OSError, TrainerError) as e:
                logger.warning("the trainer at %s does not answer (%s); waiting for its nodes to come back",
                               client.address, e)
                client = self.trainer_client = None
        if client is None:
            self.start_trainer()
        self._trainer_checked = True
        return self.trainer_client

    def stop(self) -> None:
        self.stopped = True
        shutdown.unregister(self._on_stop_signal)
        for process in [*self.inference, *([self.trainer] if self.trainer else []), *self.tools.values(),
                        *([self.judge] if self.judge else [])]:
            try:
                process.stop()
            except Exception:  # teardown goes on for the others
                logger.exception("could not stop %s", process.address)
        self.inference, self.trainer, self.trainer_client, self.tools, self.judge = [], None, None, {}, None
