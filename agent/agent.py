"""The agent that runs on every VM of a job (``spottrain-agent run``).

It registers the node in Redis and heartbeats, checks the node's health, launches elastic
torchrun with the Redis rendezvous and the job's training command, watches every notice
source of its cloud, and records its lifecycle and every event in Redis. It follows
torchrun's output for failed workers and ends torchrun when they crash-loop
(:mod:`~spottrain.agent.crashes`). On a notice the
:class:`~spottrain.agent.notices.handler.NoticeHandler` drains the node: emergency
checkpoint, explicit leave, workers stopped.

Exit codes: 0 training finished or the node drained cleanly; 1 torchrun failed; 2 bad
configuration (Redis, checkpoint directory, command); 3 the health check failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import redis

from spottrain.process_group import child_pids, descendants
from spottrain.protocol.crashes import CRASH_FIELD, TRAINED_FIELD, Crash
from spottrain.protocol.env import (
    ENV_CKPT_DIR,
    ENV_INTEGRATION,
    ENV_NODE,
    ENV_PROGRESS_FILE,
    ENV_REDIS,
    ENV_REDIS_PASSWORD,
    ENV_REDIS_USERNAME,
    ENV_RUN_ID,
)
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import TRAINING, NodeState
from spottrain.redis_conn import RedisSettings, connect, ping, settings_from_url

from .config import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_TORCHRUN_FAILED,
    EXIT_UNHEALTHY,
    AgentConfig,
    interface_of,
)
from .crashes import CrashWatch, OutputLines, OutputRelay, WorkerFailure
from .known_secrets import KnownSecrets
from .lifecycle import Lifecycle
from .local_progress import read_step
from .node_record import NodeInfo, NodeRecord
from .notices.handler import DrainOutcome, NoticeHandler
from .notices.notice import Notice, NoticeKind
from .notices.signals import SignalMonitor
from .processes import (
    WorkerUser,
    hand_over,
    resolve_worker_user,
    running,
    torchrun_command,
)
from .replica_node import ReplicaNode
from .worker_acl import WorkerAcl

log = logging.getLogger("spottrain.agent")


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.settings: RedisSettings = settings_from_url(
            cfg.redis_url, password_file=cfg.password_file
        )
        self.keys = RunKeys(cfg.run_id, cfg.key_prefix)
        self.client: redis.Redis = connect(self.settings)
        self.lifecycle = Lifecycle()
        self.record = NodeRecord(
            self.client,
            self.keys,
            NodeInfo(
                node_id=cfg.node_id,
                cloud=cfg.cloud,
                zone=cfg.zone,
                instance_type=cfg.instance_type,
                gpus=cfg.expect_gpus,
                address=cfg.address or socket.gethostname(),
            ),
        )
        # Replica mode: this node's slot and its replica's launch settings.
        self.replica = (
            ReplicaNode(self.client, self.keys, cfg, self.record, self.settings)
            if cfg.replica_mode
            else None
        )
        self.handler = NoticeHandler(
            self.client,
            self.keys,
            cfg.node_id,
            self.lifecycle,
            self.record,
            self.stop_workers,
            margin=cfg.notice_margin,
            ckpt_dir=cfg.ckpt_dir,
            workers_done=self._torchrun_finished,
            on_drained=self._after_drain,
            # Replica mode: the node leaves its replica's own rendezvous, and only once its
            # workers are down (see stop_workers).
            scoped_leave=self.replica.leave_rendezvous if self.replica else None,
            # With the Redis quorum: the replica leaves it once its step is done.
            quorum_leave=self.replica.quorum_leave if self.replica else None,
            signal_first=cfg.signals_first,
            max_window=cfg.torchrun_shutdown_timeout,
        )
        self.proc: subprocess.Popen[bytes] | None = None
        # Held while torchrun is launched and while workers are stopped, so a notice that
        # lands during the launch either stops the new torchrun or prevents it.
        self._launch_lock = threading.Lock()
        self._stopping = False
        self._loops: list[Any] = []
        self._seen_pids: set[int] = set()
        self.worker: WorkerUser | None = None
        # The workers' newest step, on this node's disk (the dead man's switch reads it).
        self._progress_dir = tempfile.mkdtemp(prefix="spottrain-agent-")
        # Workers that run as another (unprivileged) user write here too; the sticky bit
        # keeps each writer to its own file, and nobody else may list or read the directory.
        os.chmod(self._progress_dir, 0o1733)
        self.progress_path = os.path.join(self._progress_dir, "step")
        # torchrun's and its workers' output, copied to the agent's own by a relay that
        # also watches it for failed workers (see crashes.py).
        self.output_path = os.path.join(self._progress_dir, "torchrun.out")
        self._output = OutputLines()
        # What a crash keeps of the workers' lines goes to Redis: the secrets this VM knows
        # (the Redis password, what the boot read from the secret store) are taken out.
        self._secrets = KnownSecrets(
            password_file=cfg.password_file,
            environ={ENV_REDIS_PASSWORD: self.settings.password or ""},
            run_keys=self.keys,
        )
        # torchrun and the workers log in as a Redis user limited to this run's keys.
        self._worker_acl = WorkerAcl(self.client, self.keys, self.settings.password)
        self._relay: OutputRelay | None = None
        self._crashes: CrashWatch | None = None
        self._crash_loop: Crash | None = None
        self.orphan_reason = ""
        self._secret_env: dict[str, str] = {}
        self._wake = threading.Event()
        self.signals = SignalMonitor(self.handler.submit, cfg.sigterm_grace, self._wake.set)

    # -- lifecycle --------------------------------------------------------------------------
    def _advance(self, state: NodeState, reason: str = "") -> None:
        self.record.advance(self.lifecycle, state, reason)

    def run(self) -> int:
        ping(self.client, self.settings)
        self.record.register(NodeState.BOOTING.value)
        self.record.event("agent-started", pid=os.getpid(), cloud=self.cfg.cloud)
        self.record.start_heartbeat()
        self.signals.install()
        self._start_orphan_watch()
        try:
            code = self._run()
            self._linger()
            return code
        finally:
            for loop in self._loops:
                with contextlib.suppress(Exception):
                    loop.stop()
            if self.proc is not None and self.proc.poll() is None:
                self.stop_workers(5.0)
            if self._relay is not None:
                self._relay.stop()
            if self.orphan_reason:
                self.record.event("self-terminate", reason=self.orphan_reason)
            if self.replica is not None:
                self.replica.release()
                self.replica.stop_shim()
            self.record.stop(remove_heartbeat=True)
            shutil.rmtree(self._progress_dir, ignore_errors=True)
            if self.orphan_reason:
                self._end_vm()

    # -- the dead man's switch --------------------------------------------------------------
    def _start_orphan_watch(self) -> None:
        if self.cfg.orphan_timeout <= 0:
            return
        from .orphan import OrphanWatch

        watch = OrphanWatch(
            self.client,
            self.keys,
            self.progress_path,
            self.cfg.orphan_timeout,
            self._orphaned,
            workers_cpu=self._workers_cpu,
        )
        self._loops.append(watch.start())

    def _workers_cpu(self) -> tuple[int, float] | None:
        """torchrun's pid and the CPU seconds its process tree used: what tells the switch
        that a script which reports no step trains (None: no torchrun alive)."""
        from .local_progress import tree_cpu_s

        proc = self.proc
        if proc is None:
            return None
        seconds = tree_cpu_s(proc.pid)
        return None if seconds is None else (proc.pid, seconds)

    def _orphaned(self, reason: str) -> None:
        """No controller and no training: drain (an emergency checkpoint, leave), then the
        VM ends itself once :meth:`run` is done."""
        log.error("orphaned: %s; draining, then ending this VM", reason)
        self.orphan_reason = reason
        self.record.event("orphaned", reason=reason)
        self.handler.submit(
            Notice(
                source="orphan",
                kind=NoticeKind.TERMINATE,
                deadline=time.time() + self.cfg.sigterm_grace,
                detail={"reason": reason},
            )
        )
        self._wake.set()

    def _linger(self) -> None:
        """With the switch on, an agent whose torchrun has ended (training finished or
        failed) stays until the VM is ended for it (its controller's terminate reaches it
        as SIGTERM) or its own switch ends it: an idle VM must not outlive its controller."""
        if self.cfg.orphan_timeout <= 0:
            return
        if not self.orphan_reason and not self.signals.signalled.is_set():
            log.info("torchrun ended: waiting for the VM to be ended (or to end it itself)")
        while not self.orphan_reason and not self.signals.signalled.is_set():
            self._wake.wait(1.0)
        if self.orphan_reason:
            self.handler.done.wait(self.cfg.sigterm_grace + self.cfg.worker_stop_timeout)

    def _end_vm(self) -> None:
        from .orphan import end_this_vm

        ending = end_this_vm(
            self.cfg.cloud,
            self.cfg.self_terminate_cmd,
            metadata_endpoint=self.cfg.metadata_endpoint,
            request_file=self.cfg.poweroff_request,
        )
        for problem in ending.problems:
            log.error("ending this VM: %s", problem)
        if ending.how:
            log.warning("this VM is ending itself (%s): %s", ending.how, self.orphan_reason)
        else:
            log.error("could not end this VM")
        if ending.problems:
            # Best effort, the VM may be going: why it only stopped, or is still up.
            with contextlib.suppress(Exception):
                self.record.event(
                    "self-terminate-problem", how=ending.how, problems=list(ending.problems)
                )

    def _run(self) -> int:
        try:
            self.worker = resolve_worker_user(self.cfg.worker_user)
        except ValueError as exc:
            self._advance(NodeState.FAILED, str(exc))
            log.error("%s", exc)
            return EXIT_CONFIG
        if self.cfg.ckpt_dir:
            problem = _check_ckpt_dir(self.cfg.ckpt_dir)
            if problem:
                self._advance(NodeState.FAILED, problem)
                log.error("%s", problem)
                return EXIT_CONFIG
        try:
            self._secret_env = read_secret_env(self.cfg.secret_env_file)
        except ValueError as exc:
            self._advance(NodeState.FAILED, str(exc))
            log.error("%s", exc)
            return EXIT_CONFIG
        if self.cfg.health_check:
            from .health import check_health

            report = check_health(self.cfg.expect_gpus, collective=True, timeout=60)
            self.record.event("health", ok=report.ok, summary=report.summary())
            if not report.ok:
                self._advance(NodeState.FAILED, report.summary())
                log.error("health check failed: %s", report.summary())
                return EXIT_UNHEALTHY
        if self.cfg.ckpt_copy_to and self.cfg.ckpt_dir:
            problem = self._start_copier()
            if problem:
                self._advance(NodeState.FAILED, problem)
                log.error("%s", problem)
                return EXIT_CONFIG
        if self.worker is not None and self.cfg.ckpt_dir:
            problem = _hand_over_ckpt_dir(self.cfg.ckpt_dir, self.worker)
            if problem:
                self._advance(NodeState.FAILED, problem)
                log.error("%s", problem)
                return EXIT_CONFIG
        self._advance(NodeState.HEALTHY, "health check passed" if self.cfg.health_check else "")
        self._start_sources()
        if self.handler.draining:
            self.handler.done.wait(self.cfg.sigterm_grace)
            return EXIT_OK
        if self.replica and (problem := self.replica.plan(lambda: self.handler.draining)):
            if self.handler.draining:
                self.handler.done.wait(self.cfg.sigterm_grace)
                return EXIT_OK
            self._advance(NodeState.FAILED, problem)
            log.error("%s", problem)
            return EXIT_CONFIG
        self._launch()
        if self.proc is None:  # a notice came during the launch
            self.handler.done.wait(self.cfg.sigterm_grace)
            return EXIT_OK
        return self._supervise()

    # -- torchrun ---------------------------------------------------------------------------
    def _launch(self) -> None:
        conf = dict(self.cfg.rdzv_conf)
        if self.settings.tls:
            conf.setdefault("tls", "true")
        login = self._redis_login(conf)
        cmd = torchrun_command(
            script=self.cfg.train_cmd[0],
            script_args=self.cfg.train_cmd[1:],
            rdzv_endpoint=f"{self.settings.host}:{self.settings.port}",
            run_id=self.replica.launch.rdzv_id if self.replica else self.cfg.run_id,
            nnodes=self.replica.launch.nnodes if self.replica else self.cfg.nnodes,
            nproc_per_node=self.cfg.nproc_per_node,
            rdzv_conf=conf,
            local_addr=self.cfg.address or "127.0.0.1",
            monitor_interval=self.cfg.monitor_interval,
            max_restarts=self.cfg.max_restarts,
        )
        env = {
            **os.environ,
            **self.cfg.extra_env,
            ENV_NODE: self.cfg.node_id,
            ENV_RUN_ID: self.cfg.run_id,
            ENV_REDIS: self.settings.address,
            # When torchrun itself is stopped (SIGTERM), it kills its workers this long after
            # signalling them (torch's default: 30 s): at least the longest window the agent
            # gives, whose own SIGKILL ends it. (A restart for a membership change uses
            # torch's fixed 30 s instead.)
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(self.cfg.torchrun_shutdown_timeout),
            # So an integration can check that the spec names it.
            ENV_INTEGRATION: self.cfg.integration,
        }
        if self.cfg.ckpt_dir:
            env[ENV_CKPT_DIR] = self.cfg.ckpt_dir
        env[ENV_PROGRESS_FILE] = self.progress_path
        env.update(self._socket_interfaces(env))
        if self.replica is not None:
            env.update(self.replica.launch.worker_env())
            # torchft's Rust manager logs every quorum whole at info: ~100 bytes a replica a
            # step (1.25 MB a step at 12,500). Warnings only, unless the operator asked.
            env.setdefault("RUST_LOG", "warn")
        env.update(login)
        env.update(self._secret_env)
        with self._launch_lock:
            if self._stopping:
                return
            drop = self.worker.popen_kwargs() if self.worker else {}
            env = self.worker.env(env) if self.worker else env
            self._crashes = CrashWatch(
                self.cfg.node_id, time.monotonic(), redact=self._secrets.redact
            )
            with open(self.output_path, "ab") as out:
                self.proc = subprocess.Popen(
                    cmd,
                    env=env,
                    start_new_session=True,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    **drop,
                )
            self._relay = OutputRelay(self.output_path, _write_out, self._output_line).start()
        self.record.event(
            "torchrun-started",
            pid=self.proc.pid,
            command=cmd,
            **(self.replica.event_fields() if self.replica else {}),
        )

    def _socket_interfaces(self, env: dict[str, str]) -> dict[str, str]:
        """On a real VM, gloo (and torch's tensorpipe) bind to the interface of the node's own
        address, unless the job's environment names one: by default they take the address
        the hostname resolves to, which on many images is 127.0.1.1 (/etc/hosts) or nothing,
        and then every peer's connection is refused."""
        if self.cfg.cloud == "local" or not self.cfg.address:
            return {}
        iface = interface_of(self.cfg.address)
        if iface is None:
            return {}
        names = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
        return {n: iface for n in names if not env.get(n)}

    def _redis_login(self, conf: dict[str, str]) -> dict[str, str]:
        """How torchrun (``conf``, its rendezvous') and the workers (the returned variables)
        log in to Redis: as the run's workers' user (:mod:`.worker_acl`), or with the run's
        password where Redis cannot make that user (said once, in an event)."""
        password = self.settings.password
        if not password:
            return {}
        creds = self._worker_acl.ensure(time.monotonic())
        if creds is None:
            self.record.event("workers-get-the-run-password", why=self._worker_acl.problem)
            return {ENV_REDIS_PASSWORD: password}
        conf["username"] = creds.username
        return {ENV_REDIS_USERNAME: creds.username, ENV_REDIS_PASSWORD: creds.password}

    def _supervise(self) -> int:
        assert self.proc is not None
        while True:
            code = self.proc.poll()
            if code is not None:
                break
            if self.lifecycle.state is NodeState.HEALTHY and self._joined():
                self._advance(NodeState.JOINED, "workers joined a rendezvous round")
            if self._crash_loop is not None and not self._stopping and not self.handler.draining:
                self._end_crash_loop()
            self._note_training()
            self._worker_acl.ensure(time.monotonic())
            time.sleep(0.2)
        if self._relay is not None:
            self._relay.stop()
        self.record.event("torchrun-exited", code=code)
        if self.replica is not None:
            # Its generation of the replica's rendezvous may be closed now: a backfill must
            # start a new one rather than join it (see replica_node).
            self.replica.release()
        if self.handler.draining:
            self.handler.done.wait(self.cfg.sigterm_grace + self.cfg.worker_stop_timeout)
            self._finish_copy()
            return EXIT_OK
        if code == 0:
            if self.cfg.signals_first:
                self._report_script_finished()
            self._advance(NodeState.LEFT, "training finished")
            return EXIT_OK
        self._advance(NodeState.FAILED, self._failed_reason(code))
        return EXIT_TORCHRUN_FAILED

    def _report_script_finished(self) -> None:
        """A plain script tells nobody it finished: its workers all returning 0, which
        torchrun itself takes for the job done, is all there is. Said to the run here, or
        the controller takes the node for lost and backfills it into a closed rendezvous.
        A script of ours (SpotCheckpoints) has reported its final step already."""
        step = read_step(self.progress_path)
        try:
            if self.client.hget(self.keys.progress, "finished") != b"1":
                mapping = {"finished": "1"}
                if step is not None:
                    mapping["final_step"] = str(step)
                self.client.hset(self.keys.progress, mapping=mapping)
        except redis.RedisError as exc:
            log.warning("end of training not reported to Redis: %s", exc)
            return
        self.record.event("script-finished", step="" if step is None else step)

    # -- the workers' failures (crashes.py) ------------------------------------------------
    def _output_line(self, line: str) -> None:
        """A line of torchrun's output (the relay's thread)."""
        failure = self._output.feed(line)
        if failure is not None:
            self._worker_failed(failure)

    def _worker_failed(self, failure: WorkerFailure) -> None:
        watch = self._crashes
        if watch is None or self.handler.draining or self._crash_loop is not None:
            return  # a drain stops the workers on purpose; a loop found is being ended
        step = read_step(self.progress_path)
        crash = watch.failed(failure, time.monotonic(), step, self._gone_version())
        self.record.put(**{CRASH_FIELD: crash.to_json()})
        self.record.mark(**{TRAINED_FIELD: ""})
        self.record.event(
            "workers-failed",
            code=crash.code,
            local_rank=crash.rank,
            line=crash.line,
            step="" if crash.step is None else crash.step,
            ran_s=round(crash.ran_s, 1),
            in_a_row=crash.count,
        )
        if crash.loop:
            log.error("crash loop: %s; ending torchrun", crash.why())
            self._crash_loop = crash

    def _end_crash_loop(self) -> None:
        """End torchrun for good: leave the rendezvous first (torchrun stopping without
        leaving would close it, and every other node's torchrun would end too), kill the
        workers (nothing to save of workers that fail at every start, and a save would
        look like training), then stop torchrun."""
        if self.replica is None:
            from .rendezvous.membership import leave_node

            with contextlib.suppress(LookupError, redis.RedisError):
                leave_node(self.client, self.keys, self.cfg.node_id)
        proc = self.proc
        if proc is not None:
            for pid in child_pids().get(proc.pid, []):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self.stop_workers(5.0)

    def _gone_version(self) -> str | None:
        """The rendezvous' version of its gone members ("" before any went), which moves
        when a peer leaves or dies; None when Redis does not answer."""
        keys = self.replica.rdzv_keys if self.replica else self.keys
        try:
            raw = self.client.hget(keys.rdzv_gone, "#v")
        except redis.RedisError:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw or "")

    def _note_training(self) -> None:
        """Mark the node once its workers trained for a while without failing: the
        controller's give-up streak of failures at no known step ends on it."""
        watch = self._crashes
        joined = self.lifecycle.state in TRAINING
        if watch is not None and watch.trains(time.monotonic(), joined):
            self.record.mark(**{TRAINED_FIELD: "1"})

    def _failed_reason(self, code: int) -> str:
        """Why the node failed when torchrun exited with ``code``: the crash loop the
        agent ended, or the workers' last failure (or torchrun's last words) once torchrun
        gave up by itself; the crash goes to the node's record for the controller."""
        crash = self._crash_loop
        if crash is not None:
            return f"crash loop: {crash.why()}"
        if self._crashes is None:
            return f"torchrun exited with code {code}"
        crash = self._crashes.gave_up(code, self._output)
        self.record.put(**{CRASH_FIELD: crash.to_json()})
        return f"torchrun exited with code {code}: {crash.why()}"

    def _start_copier(self) -> str | None:
        """Bring in the newest checkpoint copy if the volume lacks it, then copy this node's
        commits out in the background. Returns what went wrong, or None."""
        from spottrain.cloud.storage import StorageError

        from .checkpoint.copy import CheckpointCopier

        try:
            self.copier = CheckpointCopier(
                self.cfg.ckpt_copy_to,
                self.cfg.ckpt_dir,
                self.client,
                self.keys,
                self.cfg.node_id,
                self.record,
            )
            self.copier.pull_newest()
        except (StorageError, OSError, ValueError) as exc:
            # Starting from an older checkpoint than the job reached would redo (or lose)
            # work silently: fail the node instead; the controller replaces it.
            return f"cannot bring in the newest checkpoint copy from {self.cfg.ckpt_copy_to}: {exc}"
        self.copier.start()
        self._loops.append(self.copier)
        return None

    def _finish_copy(self) -> None:
        """After a drain, copy its checkpoint out before the VM goes, within the deadline."""
        copier = getattr(self, "copier", None)
        outcome = self.handler.outcome
        if copier is None or outcome is None or outcome.committed_step is None:
            return
        left = (self.handler.deadline or time.time() + 30) - time.time() - 1.0
        if not copier.wait_copied(outcome.committed_step, max(0.0, left)):
            self.record.event("checkpoint-copy-missed", step=outcome.committed_step)

    def _after_drain(self, outcome: DrainOutcome, notices: list[Notice]) -> None:
        """Let an Auto Scaling group that holds this VM terminate it now: the checkpoint
        has committed (or its deadline passed) and the node has left."""
        if not (self.cfg.asg_name and self.cfg.asg_lifecycle_hook):
            return
        if not any(n.kind is NoticeKind.SCALE_IN for n in notices):
            return  # no hook holds the VM (a spot notice, or the controller's drain)
        from .asg_lifecycle import AsgHook, complete, hook_region

        hook = AsgHook(
            group=self.cfg.asg_name,
            hook=self.cfg.asg_lifecycle_hook,
            instance_id=self.cfg.node_id,
            region=hook_region(self.cfg.zone),
        )
        problem = complete(hook)
        if problem:
            self.record.event("lifecycle-action-failed", error=problem, hook=hook.hook)
        else:
            self.record.event(
                "lifecycle-action-completed",
                hook=hook.hook,
                group=hook.group,
                committed_step=outcome.committed_step,
            )

    def _joined(self) -> bool:
        try:
            keys = self.replica.rdzv_keys if self.replica else self.keys
            return bool(self.client.hexists(keys.rdzv_members, self.cfg.node_id))
        except redis.RedisError:
            return False

    def _torchrun_finished(self) -> bool:
        """torchrun exited with 0 on its own: training is over, nothing needs saving."""
        proc = getattr(self, "proc", None)
        return proc is not None and proc.poll() == 0

    def stop_workers(self, timeout: float) -> None:
        """SIGTERM torchrun and its workers, then SIGKILL everything of theirs left after
        ``timeout`` seconds.

        Workers live in sessions of their own, so each is signalled, but nothing below them
        (data loader processes belong to their worker, which stops them itself).
        """
        with self._launch_lock:
            self._stopping = True
            proc = self.proc
        if proc is None:
            return
        tree = self._tree()
        workers = [proc.pid, *(p for p in child_pids().get(proc.pid, []))]
        for pid in workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._alive_pids():
            time.sleep(0.1)
        left = self._alive_pids()
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if left:
            self.record.event("workers-killed", pids=left, of=len(tree))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if self.replica is not None:
            # Only once the workers are down: torchrun would tear them down on its own
            # member's leave, cutting short the workers' own leave from the quorum.
            self.replica.leave_rendezvous()
            # Its managers are gone: their ids leave the Redis quorum now rather than at
            # their heartbeat timeout (a no-op with the lighthouse).
            self.replica.quorum_leave(now=True)

    def _tree(self) -> list[int]:
        assert self.proc is not None
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        self._seen_pids.update(pids)
        return pids

    def _alive_pids(self) -> list[int]:
        if self.proc is not None and self.proc.poll() is None:
            self._tree()
        return running(self._seen_pids)

    # -- notices ----------------------------------------------------------------------------
    def _start_sources(self) -> None:
        from .notices.sources import start_sources

        def on_error(msg: str) -> None:
            log.warning("notice watcher: %s", msg)
            self.record.event("watcher-error", message=msg)

        self._loops.extend(
            start_sources(
                self.cfg.cloud,
                self.client,
                self.keys,
                self.cfg.node_id,
                self.handler.submit,
                on_error,
                metadata_endpoint=self.cfg.metadata_endpoint,
                poll_interval=self.cfg.poll_interval,
            )
        )


def _write_out(chunk: bytes) -> None:
    """Write torchrun's output on as the agent's own (the node's log)."""
    out = getattr(sys.stdout, "buffer", None)
    if out is not None:
        out.write(chunk)
    else:
        sys.stdout.write(chunk.decode(errors="replace"))
    sys.stdout.flush()


def read_secret_env(path: str) -> dict[str, str]:
    """The job's secret variables from ``path`` (an image job's; "": none).

    Raises:
        ValueError: the file cannot be read, or is not one (one line naming the file and
            the fix; never a value).
    """
    from spottrain.protocol.boot import parse_secret_env

    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
        raise ValueError(
            f"cannot read the job's secret variables from {path} ({why}): the agent reads it "
            "as root (an image whose USER is not root cannot); boot a new VM if it is gone"
        ) from None
    return parse_secret_env(text, path)


def _check_ckpt_dir(path: str) -> str | None:
    from .checkpoint.directory import CheckpointDir
    from .checkpoint.files import CheckpointDirError

    try:
        CheckpointDir(path).check_writable()
    except CheckpointDirError as exc:
        return exc.strerror
    return None


def _hand_over_ckpt_dir(path: str, worker: WorkerUser) -> str | None:
    try:
        hand_over(path, worker)
    except OSError as exc:
        return (
            f"checkpoint directory {path}: cannot make {exc.filename or path} the worker "
            f"user {worker.name}'s ({exc.strerror}); a network file system that squashes "
            f"root refuses this: create the directory as uid {worker.uid} there, or set "
            "SPOTTRAIN_WORKER_USER= (empty) to run the workers as root"
        )
    return None
