"""How one agent is configured (``spottrain-agent run``'s flags and environment), and its
exit codes."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from spottrain.protocol.env import (
    ENV_INTEGRATION,
    ENV_QUORUM_HEARTBEAT_TIMEOUT,
    ENV_QUORUM_JOIN_TIMEOUT,
    ENV_QUORUM_RELAY_GROUP,
    ENV_QUORUM_RELAY_PORT,
    ENV_QUORUM_WAIT_REPLICAS,
)
from spottrain.protocol.keys import DEFAULT_PREFIX
from spottrain.quorum.model import DEFAULT_JOIN_TIMEOUT_MS
from spottrain.redis_conn import parse_endpoint

from .replica_launch import DEFAULT_MANAGER_PORT, DEFAULT_SHIM_PORT, QUORUMS, check_lighthouse

# Where a quorum relay listens on the agent's address for its group's VMs (next to the
# shim's 29511 and the manager's 29512).
DEFAULT_RELAY_PORT = 29513

EXIT_OK, EXIT_TORCHRUN_FAILED, EXIT_CONFIG, EXIT_UNHEALTHY = 0, 1, 2, 3

# --rdzv-conf keys that would carry a secret; password_env and password_file only say where
# it is, and stay allowed.
SECRET_RDZV_KEYS = frozenset({"password", "requirepass", "token"})


# train.integration's values: "plain" (a script that imports nothing of ours) gets SIGTERM at
# once on a notice; the others answer the agent's checkpoint request through Redis.
INTEGRATIONS = ("sdk", "hf", "accelerate", "lightning", "plain")


class AgentConfigError(ValueError):
    """The agent cannot start as configured; the message says what to change."""


@dataclass
class AgentConfig:
    redis_url: str
    run_id: str
    node_id: str
    train_cmd: list[str]
    nnodes: str = "1:1"
    nproc_per_node: int = 1
    cloud: str = "local"
    zone: str = ""
    instance_type: str = ""
    address: str = ""
    expect_gpus: int = 0
    health_check: bool = True
    ckpt_dir: str = ""
    ckpt_copy_to: str = ""
    password_file: str | None = None
    key_prefix: str = DEFAULT_PREFIX
    notice_margin: float = 5.0
    sigterm_grace: float = 60.0
    worker_stop_timeout: float = 150.0
    # How the training script meets spottrain (the spec's train.integration).
    integration: str = "sdk"
    metadata_endpoint: str | None = None
    poll_interval: float = 2.0
    monitor_interval: float = 0.1
    max_restarts: int = 100
    asg_name: str = ""
    asg_lifecycle_hook: str = ""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    # The unprivileged user torchrun and the workers run as when the agent is root (the
    # systemd unit sets "spottrain"); empty: the agent's own user.
    worker_user: str = ""
    # The dead man's switch (agent/orphan.py): seconds without a controller heartbeat and
    # without a local training step after which the VM ends itself; 0: never.
    orphan_timeout: float = 0.0
    self_terminate_cmd: str = ""
    # An image job's (its agent runs in a container): the file whose creation asks the host
    # to power off, instead of `shutdown`; and the root-only file of the job's secret
    # variables (spottrain.protocol.boot.SECRET_ENV_FILE), passed on to the workers.
    poweroff_request: str = ""
    secret_env_file: str = ""
    # Replica mode (train.fault_tolerance: replica): each replica of nodes_per_replica nodes
    # runs its own torchrun; elastic runs one torchrun over every node, as before.
    fault_tolerance: str = "elastic"
    nodes_per_replica: int = 1
    min_replicas: int = 1
    # HOST:PORT of the run's lighthouse; empty: read from Redis at each launch (the
    # controller writes it), waiting up to lighthouse_wait seconds.
    lighthouse: str = ""
    lighthouse_wait: float = 300.0
    # The workers' manager port; 0: a free port at each launch (the local cloud, whose
    # "VMs" share one host, uses that whatever is set here).
    manager_port: int = DEFAULT_MANAGER_PORT
    # Where the replicas' quorum lives: "redis" (the run's Redis; this agent serves it to
    # its workers as torchft's lighthouse protocol on quorum_port) or "lighthouse"
    # (torchft's own, run by the controller; kept for comparison).
    quorum: str = "redis"
    # The local lighthouse shim's port; 0: a free port (the local cloud always uses one).
    quorum_port: int = DEFAULT_SHIM_PORT
    # Redis replicas that must hold each formed round before its answer is used (WAIT).
    quorum_wait_replicas: int = 0
    # Seconds without a heartbeat before the Redis quorum drops a replica.
    quorum_heartbeat_timeout_s: float = 1.0
    # Milliseconds a changed Redis quorum waits for late replicas (the spec's resolved
    # train.replica.join_timeout_ms).
    quorum_join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS
    # Replicas per quorum relay (the spec's train.replica.relay_group_size, resolved); 0:
    # none. The relay listens on address:quorum_relay_port (0: a free port).
    quorum_relay_group: int = 0
    quorum_relay_port: int = DEFAULT_RELAY_PORT

    @property
    def replica_mode(self) -> bool:
        return self.fault_tolerance == "replica"

    @property
    def signals_first(self) -> bool:
        """A notice SIGTERMs the workers at once: nothing in a plain script answers the
        checkpoint request, so waiting for its commit would only eat the script's window."""
        return self.integration == "plain"

    @property
    def torchrun_shutdown_timeout(self) -> int:
        """Seconds a SIGTERMed torchrun lets its workers run before it SIGKILLs them
        (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; torch's own default is 30 s): at least the
        longest window the agent gives them (``--worker-stop-timeout``, the SIGTERM grace),
        so torchrun never kills a saving worker before the agent's own deadline does."""
        return int(-(-max(self.worker_stop_timeout, self.sigterm_grace) // 1))

    @property
    def redis_quorum(self) -> bool:
        """Replica mode with the quorum in Redis (this agent runs the lighthouse shim)."""
        return self.replica_mode and self.quorum == "redis"

    def validate(self) -> None:
        if self.cloud not in ("local", "aws", "gcp"):
            raise AgentConfigError(f"cloud {self.cloud!r} is not one of local, aws, gcp")
        if not self.train_cmd:
            raise AgentConfigError(
                "no training command: give it after `--` or set SPOTTRAIN_TRAIN_CMD "
                "(e.g. `train.py --steps 1000`)"
            )
        if self.nproc_per_node < 1:
            raise AgentConfigError(f"nproc-per-node {self.nproc_per_node} must be at least 1")
        if not 0 < self.poll_interval <= 5:
            raise AgentConfigError(
                f"poll interval {self.poll_interval} s must be in (0, 5]: an AWS notice "
                "gives two minutes and must be seen within seconds"
            )
        secret = sorted(k for k in self.rdzv_conf if k.lower() in SECRET_RDZV_KEYS)
        if secret:
            # Also for an agent built in code: torchrun would carry the value on its command
            # line (world-readable in /proc) and the torchrun-started event would store it.
            raise AgentConfigError(
                f"rdzv_conf {', '.join(secret)} is refused: it would put the secret on "
                "torchrun's command line and in the run's event stream; give the Redis "
                "password through the environment or a password file instead"
            )
        if self.orphan_timeout < 0:
            raise AgentConfigError(
                f"orphan timeout {self.orphan_timeout:g} s must be >= 0 (0 turns it off)"
            )
        if self.integration not in INTEGRATIONS:
            raise AgentConfigError(
                f"integration {self.integration!r} (--integration, {ENV_INTEGRATION}) must be "
                f"one of {', '.join(INTEGRATIONS)}"
            )
        if self.integration != "sdk" and self.replica_mode:
            raise AgentConfigError(
                f"integration {self.integration} cannot run in replica mode, which drives "
                "torchft from spottrain's TrainSession: use --fault-tolerance elastic or "
                "--integration sdk"
            )
        if not 0 <= self.notice_margin < 60:
            raise AgentConfigError(
                f"notice margin {self.notice_margin:g} s (--notice-margin) must be in 0..60 "
                "seconds: the time the agent keeps for itself before a notice's deadline"
            )
        self._validate_replica()
        lo, sep, hi = self.nnodes.partition(":")
        hi = hi if sep else lo
        if not (lo.isdigit() and hi.isdigit()) or not 1 <= int(lo) <= int(hi):
            raise AgentConfigError(
                f"nnodes {self.nnodes!r} must be N or MIN:MAX with 1 <= MIN <= MAX (e.g. 1:4)"
            )

    def _validate_replica(self) -> None:
        if self.fault_tolerance not in ("elastic", "replica"):
            raise AgentConfigError(
                f"fault tolerance {self.fault_tolerance!r} (--fault-tolerance, "
                "SPOTTRAIN_FAULT_TOLERANCE) must be elastic or replica"
            )
        for name, value in (
            ("nodes-per-replica", self.nodes_per_replica),
            ("min-replicas", self.min_replicas),
        ):
            if value < 1:
                env = "SPOTTRAIN_" + name.replace("-", "_").upper()
                raise AgentConfigError(f"{name} {value} ({env}) must be at least 1")
        if self.quorum not in QUORUMS:
            raise AgentConfigError(
                f"quorum {self.quorum!r} (--quorum, SPOTTRAIN_QUORUM) must be one of "
                f"{', '.join(QUORUMS)}"
            )
        if not 0.2 <= self.quorum_heartbeat_timeout_s <= 300:
            raise AgentConfigError(
                f"quorum heartbeat timeout {self.quorum_heartbeat_timeout_s:g} s "
                f"(--quorum-heartbeat-timeout, {ENV_QUORUM_HEARTBEAT_TIMEOUT}) must be in "
                "0.2..300 seconds"
            )
        if not 50 <= self.quorum_join_timeout_ms <= 60_000:
            raise AgentConfigError(
                f"quorum join timeout {self.quorum_join_timeout_ms} ms (--quorum-join-timeout, "
                f"{ENV_QUORUM_JOIN_TIMEOUT}) must be in 50..60000 milliseconds"
            )
        if not 0 <= self.quorum_wait_replicas <= 16:
            raise AgentConfigError(
                f"quorum wait replicas {self.quorum_wait_replicas} (--quorum-wait-replicas, "
                f"{ENV_QUORUM_WAIT_REPLICAS}) must be in 0..16 (Redis replicas to WAIT for)"
            )
        if not (self.quorum_relay_group == 0 or 2 <= self.quorum_relay_group <= 1000):
            raise AgentConfigError(
                f"quorum relay group {self.quorum_relay_group} (--quorum-relay-group, "
                f"{ENV_QUORUM_RELAY_GROUP}) must be 0 (no relays) or 2..1000 replicas"
            )
        if not 0 <= self.quorum_relay_port < 65536:
            raise AgentConfigError(
                f"quorum relay port {self.quorum_relay_port} (--quorum-relay-port, "
                f"{ENV_QUORUM_RELAY_PORT}) must be in 0..65535 (0: a free port)"
            )
        if not 0 <= self.quorum_port < 65536:
            raise AgentConfigError(
                f"quorum port {self.quorum_port} (--quorum-port) must be in 0..65535 "
                "(0: a free port)"
            )
        if not 0 <= self.manager_port < 65536:
            raise AgentConfigError(
                f"manager port {self.manager_port} must be in 0..65535 (0: a free port)"
            )
        if self.lighthouse_wait < 0:
            raise AgentConfigError(f"lighthouse wait {self.lighthouse_wait:g} s must be >= 0")
        if self.lighthouse:
            try:
                check_lighthouse(self.lighthouse, "lighthouse (--lighthouse, SPOTTRAIN_LIGHTHOUSE)")
            except ValueError as exc:
                raise AgentConfigError(str(exc)) from None


def own_address(redis_url: str) -> str:
    """The address this VM's peers reach it at: the source address of its route to the run's
    Redis, which every node reaches over the fleet's network (a VM's hostname may resolve to
    127.0.1.1, and 127.0.0.1 is every VM's own loopback). No packet is sent: connecting a UDP
    socket only asks the kernel for the route.

    Raises:
        AgentConfigError: no route to Redis (the message names the host).
    """
    host, port, _, _ = parse_endpoint(redis_url)
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError as e:
        raise AgentConfigError(
            f"cannot find this VM's address: no route to the run's Redis at {host}:{port} "
            f"({e}); set SPOTTRAIN_ADDRESS (--address) to the address other nodes reach it at"
        ) from None


def interface_of(address: str) -> str | None:
    """The network interface holding the IPv4 ``address``, or None (not found, or not an
    IPv4 address of this machine)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None
