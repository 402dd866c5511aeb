"""The ``SPOTTRAIN_*`` environment variables, by name, in one place.

Who sets them and who reads them:

- the boot script (``bootstrap``) sets the agent's: run, node, cloud, Redis, the training
  command and the node shape; ``spottrain-agent run`` reads each as the default of a flag;
- the agent sets the workers' (torchrun and the training script): node, run, Redis, the
  checkpoint directory; the rendezvous handler adds the round and the member;
- the SDK (:mod:`spottrain.agent.sdk`) reads the workers' (``ENV_CKPT_DIR``, ``ENV_REDIS``,
  ``ENV_ROUND``, ``ENV_NODE``, ``ENV_COPY_TO`` are its documented names);
- operators and tests set the rest (home, catalog, failpoints, crash points).

The names are a format: a fleet's boot script and the agent it installs may come from
different releases, so a name never changes.
"""

from __future__ import annotations

# Every spottrain variable starts so (the job spec refuses to set one of them in train.env).
ENV_PREFIX = "SPOTTRAIN_"

# -- the worker's, read by the SDK (documented; re-exported by spottrain.agent.sdk) ---------
ENV_CKPT_DIR = "SPOTTRAIN_CKPT_DIR"
ENV_REDIS = "SPOTTRAIN_REDIS"
ENV_ROUND = "SPOTTRAIN_RDZV_ROUND"
ENV_NODE = "SPOTTRAIN_NODE_ID"
ENV_COPY_TO = "SPOTTRAIN_CKPT_COPY_TO"
# -- the agent's log shipping (spec `logs:`; unset LOGS_TO: <ENV_COPY_TO>/logs) --------------
ENV_LOGS_TO = "SPOTTRAIN_LOGS_TO"
ENV_LOGS_CHUNK_S = "SPOTTRAIN_LOGS_CHUNK_S"
ENV_LOGS_CHUNK_MB = "SPOTTRAIN_LOGS_CHUNK_MB"
ENV_LOGS_MAX_MB = "SPOTTRAIN_LOGS_MAX_MB"
ENV_LOGS_BACKLOG_MB = "SPOTTRAIN_LOGS_BACKLOG_MB"
ENV_LOGS_FILE = "SPOTTRAIN_LOGS_FILE"  # the file the node's output is appended to
ENV_LOGS_FILE_MAX_MB = "SPOTTRAIN_LOGS_FILE_MAX_MB"  # truncate it once shipped past this
ENV_VM_ID = "SPOTTRAIN_VM_ID"  # this VM's id (else asked of the cloud's metadata server)

# -- the agent's, set by the boot script (each the default of a `spottrain-agent run` flag) --
ENV_RUN_ID = "SPOTTRAIN_RUN_ID"
ENV_CLOUD = "SPOTTRAIN_CLOUD"
ENV_ZONE = "SPOTTRAIN_ZONE"
ENV_INSTANCE_TYPE = "SPOTTRAIN_INSTANCE_TYPE"
ENV_ADDRESS = "SPOTTRAIN_ADDRESS"
ENV_NNODES = "SPOTTRAIN_NNODES"
ENV_NPROC_PER_NODE = "SPOTTRAIN_NPROC_PER_NODE"
ENV_EXPECT_GPUS = "SPOTTRAIN_EXPECT_GPUS"
ENV_TRAIN_CMD = "SPOTTRAIN_TRAIN_CMD"
ENV_ORPHAN_TIMEOUT = "SPOTTRAIN_ORPHAN_TIMEOUT"
ENV_REDIS_PASSWORD = "SPOTTRAIN_REDIS_PASSWORD"
# The Redis user the password is for (the workers': agent/worker_acl.py); unset: the default.
ENV_REDIS_USERNAME = "SPOTTRAIN_REDIS_USERNAME"
ENV_REDIS_PASSWORD_FILE = "SPOTTRAIN_REDIS_PASSWORD_FILE"
ENV_SIGTERM_GRACE = "SPOTTRAIN_SIGTERM_GRACE"
ENV_METADATA_ENDPOINT = "SPOTTRAIN_METADATA_ENDPOINT"
ENV_MAX_RESTARTS = "SPOTTRAIN_MAX_RESTARTS"
ENV_ASG_NAME = "SPOTTRAIN_ASG_NAME"
ENV_ASG_LIFECYCLE_HOOK = "SPOTTRAIN_ASG_LIFECYCLE_HOOK"
ENV_SELF_TERMINATE_CMD = "SPOTTRAIN_SELF_TERMINATE_CMD"
# An image job's agent runs in a container: its secret variables come in a root-only file
# the host's boot wrote (not docker's --env-file, which `docker inspect` shows), and it asks
# the host to power off by creating a file a systemd path unit of the host watches.
ENV_SECRET_ENV_FILE = "SPOTTRAIN_SECRET_ENV_FILE"
ENV_POWEROFF_REQUEST = "SPOTTRAIN_POWEROFF_REQUEST"
ENV_WORKER_USER = "SPOTTRAIN_WORKER_USER"

# -- train.integration: how the script meets spottrain -----------------------------------------
# The agent's, set by the boot script when it is not "sdk" (the default): sdk, hf, accelerate,
# lightning or plain ("plain": a notice sends the workers SIGTERM at once). The agent sets it
# for the workers too, always, so an integration can check that the spec names it.
ENV_INTEGRATION = "SPOTTRAIN_INTEGRATION"

# -- replica mode (train.fault_tolerance: replica) -------------------------------------------
# The agent's, set by the boot script: the mode, the replica's size in nodes, the quorum's
# floor and where the lighthouse listens (host:port, reached over http).
ENV_FAULT_TOLERANCE = "SPOTTRAIN_FAULT_TOLERANCE"
ENV_NODES_PER_REPLICA = "SPOTTRAIN_NODES_PER_REPLICA"
ENV_MIN_REPLICAS = "SPOTTRAIN_MIN_REPLICAS"
ENV_LIGHTHOUSE = "SPOTTRAIN_LIGHTHOUSE"
# Which quorum the replicas use: "redis" (spottrain.quorum, in the run's Redis; the default)
# or "lighthouse" (torchft's own, run by the controller).
ENV_QUORUM = "SPOTTRAIN_QUORUM"
# With the Redis quorum: how many Redis replicas must have a formed round before its answer
# is used (WAIT; 0: none). Set with a replicated Redis and min-replicas-to-write.
ENV_QUORUM_WAIT_REPLICAS = "SPOTTRAIN_QUORUM_WAIT_REPLICAS"
# With redis: seconds without a heartbeat before a replica is dropped (the agent's and, for
# the watchdog, the workers'). Longer for large fleets: heartbeats cost Redis N x 5 / timeout
# calls a second.
ENV_QUORUM_HEARTBEAT_TIMEOUT = "SPOTTRAIN_QUORUM_HEARTBEAT_TIMEOUT"
# With the Redis quorum: milliseconds a changed quorum waits for late replicas
# (train.replica.join_timeout_ms, resolved; unset: 250).
ENV_QUORUM_JOIN_TIMEOUT = "SPOTTRAIN_QUORUM_JOIN_TIMEOUT"
# With the Redis quorum: replicas per quorum relay (train.replica.relay_group_size, resolved;
# unset or 0: no relays, each VM asks Redis itself) and the port the relays listen on.
ENV_QUORUM_RELAY_GROUP = "SPOTTRAIN_QUORUM_RELAY_GROUP"
ENV_QUORUM_RELAY_PORT = "SPOTTRAIN_QUORUM_RELAY_PORT"
# The workers', set by the agent for one replica: its slot ("replica-<j>"), the manager's
# fixed port on the replica's first node.
ENV_REPLICA_ID = "SPOTTRAIN_REPLICA_ID"
ENV_MANAGER_PORT = "SPOTTRAIN_MANAGER_PORT"

# -- set by the rendezvous handler for the workers of one round -------------------------------
ENV_RDZV_MEMBER = "SPOTTRAIN_RDZV_MEMBER"

# -- the local cloud and the local launcher --------------------------------------------------
ENV_LOCAL_VM_PID = "SPOTTRAIN_LOCAL_VM_PID"  # the local VM's pid: how its agent ends it
ENV_PROGRESS_FILE = "SPOTTRAIN_PROGRESS_FILE"  # where the local launcher's workers report

# -- operators and tests --------------------------------------------------------------------
ENV_HOME = "SPOTTRAIN_HOME"  # the controller's run records (default ~/.spottrain)
ENV_CATALOG = "SPOTTRAIN_CATALOG"  # a catalog file in place of the shipped one
ENV_FAILPOINT = "SPOTTRAIN_FAILPOINT"  # the checkpoint writer's failpoints (tests)
ENV_CRASH_AT = "SPOTTRAIN_CRASH_AT"  # crash the controller at a named point (tests)
