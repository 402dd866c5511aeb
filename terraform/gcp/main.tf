locals {
  # Every name derives from the run id, so two runs in one project never collide and an
  # operator can tell what belongs to which run from a listing.
  name           = "spottrain-${var.run_id}"
  region         = join("-", slice(split("-", var.zone), 0, 2))
  fleet_tag      = local.name
  controller_tag = "${local.name}-controller"

  # spottrain-job (cloud/base.py's TAG_JOB) is how the controller finds the run's VMs: it lists
  # instances by this label alone, so a controller that lost its memory adopts the fleet.
  own_labels = {
    "spottrain-job"        = var.run_id
    "spottrain-managed-by" = "terraform"
  }
  labels = merge(var.labels, local.own_labels)
  # The controller VM must not carry spottrain-job: the controller would count its own VM as a
  # node of the fleet. It gets a label of its own instead.
  controller_own_labels = {
    "spottrain-controller" = var.run_id
    "spottrain-managed-by" = "terraform"
  }
  controller_labels = merge(var.labels, local.controller_own_labels)

  # A3 and A2 types come with their GPUs attached; the count is what the agent's boot health
  # check requires (SPOTTRAIN_EXPECT_GPUS) and the default number of workers.
  gpus_by_machine_type = {
    "a3-highgpu-8g"  = 8
    "a3-megagpu-8g"  = 8
    "a3-ultragpu-8g" = 8
    "a2-highgpu-8g"  = 8
    "a2-ultragpu-8g" = 8
    "a2-megagpu-16g" = 16
  }
  expect_gpus    = local.gpus_by_machine_type[var.machine_type]
  nproc_per_node = coalesce(var.nproc_per_node, local.expect_gpus)
  # A3 Ultra boots only from Hyperdisk; A3 needs gVNIC (the image must support it).
  boot_disk_type = coalesce(var.boot_disk_type, startswith(var.machine_type, "a3-ultragpu-") ? "hyperdisk-balanced" : "pd-balanced")
  nic_type       = startswith(var.machine_type, "a3-") ? "GVNIC" : null

  # The smallest share each Filestore tier accepts, GiB.
  filestore_min_gb = {
    BASIC_SSD      = 2560
    ZONAL          = 1024
    HIGH_SCALE_SSD = 10240
  }

  # Checkpoints of this run live in a directory of their own on the share, so runs sharing a
  # Filestore never restore each other's state (bootstrap.py's run_ckpt_dir).
  volume_root = "/mnt/spottrain"
  ckpt_dir    = "${local.volume_root}/${var.run_id}"

  # The mount, as an /etc/fstab line: systemd then has a mount unit for /mnt/spottrain at
  # every boot, which the agent's RequiresMountsFor= orders it after (and keeps mounted until
  # the agent's emergency checkpoint is done). nofail: a VM whose share does not mount still
  # boots and can be inspected; the agent, which requires the mount, stays down. The rest are
  # Filestore's recommended NFS options.
  filestore_ip     = google_filestore_instance.ckpt.networks[0].ip_addresses[0]
  filestore_export = "${local.filestore_ip}:/${var.filestore_share_name}"
  nfs_fstab_entry  = "${local.filestore_export} ${local.volume_root} nfs rw,hard,timeo=600,retrans=3,rsize=262144,wsize=1048576,resvport,_netdev,nofail 0 0"

  # Buckets the nodes need: the checkpoint copies (read and write) and a code archive on
  # Cloud Storage (read).
  copy_bucket    = var.checkpoint_copy_to == "" ? "" : split("/", trimprefix(var.checkpoint_copy_to, "gs://"))[0]
  archive_bucket = startswith(var.code_archive_url, "gs://") ? split("/", trimprefix(var.code_archive_url, "gs://"))[0] : ""
  # Where this run's copies go inside the copy bucket: the agent writes under
  # <checkpoint_copy_to>/<run id>/ (agent/checkpoint/copy.py), and the nodes may touch nothing else.
  copy_path       = trim(trimprefix(var.checkpoint_copy_to, "gs://${local.copy_bucket}"), "/")
  copy_run_prefix = local.copy_path == "" ? "${var.run_id}/" : "${local.copy_path}/${var.run_id}/"

  # The training command as SPOTTRAIN_TRAIN_CMD holds it: shell-quoted the way Python's
  # shlex.join does (the agent splits it with shlex), then escaped for a double-quoted systemd
  # EnvironmentFile value (backslash and double quote), as bootstrap.py's render_env_file.
  train_cmd_shell = join(" ", [
    for a in var.train_command :
    can(regex("^[A-Za-z0-9_@%+=:,./-]+$", a)) ? a : "'${replace(a, "'", "'\"'\"'")}'"
  ])
  train_cmd_env = replace(replace(local.train_cmd_shell, "\\", "\\\\"), "\"", "\\\"")

  # The code step of the startup script, chosen here so the script holds only the one that
  # applies (bootstrap.py's _code_lines).
  code_fetch = var.code_archive_url != "" ? templatefile("${path.module}/code_archive.sh.tftpl", local.code_archive_vars) : templatefile("${path.module}/code_git.sh.tftpl", local.code_git_vars)
  code_archive_vars = {
    archive_url    = var.code_archive_url
    archive_sha256 = var.code_archive_sha256
  }
  code_git_vars = {
    git_repo         = var.git_repo
    git_commit       = var.git_commit
    git_workdir      = var.git_subdir == "" ? "/opt/job" : "/opt/job/${var.git_subdir}"
    git_token_secret = var.git_token_secret
    git_token_user   = var.git_token_user
  }

  # --- the job's secrets, read at boot -------------------------------------------------------
  # The secrets the nodes read besides the Redis password (train.secret_env's and the git
  # token), exactly these. The Redis password's own grant (iam.tf) is left out of the set, so
  # no binding is managed twice (destroying one copy would revoke the other).
  job_secrets = setsubtract(toset(concat(values(var.secret_env), var.git_token_secret == "" ? [] : [var.git_token_secret])), toset([var.redis_password_secret]))
  # train.secret_env as the startup script's table, one "NAME SECRET" line each (both
  # validated to hold no space or quote), each ending in a newline; empty without secrets.
  # tests/unit/terraform/test_terraform_gcp.py mirrors this expression; change both together.
  secret_env_table = join("", [for name, secret in var.secret_env : "${name} ${secret}\n"])

  # train.integration as the agent's SPOTTRAIN_INTEGRATION line (ending in a newline); empty
  # for "sdk", the agent's default, so an SDK job's boot script is byte for byte what it was
  # before the variable existed. tests/unit/terraform/replica_values.py mirrors it.
  integration_env_line = var.integration == "sdk" ? "" : "SPOTTRAIN_INTEGRATION=\"${var.integration}\"\n"

  # --- replica mode ---------------------------------------------------------------------------
  replica = var.fault_tolerance == "replica"
  # Which quorum the replicas use: the Redis quorum (the default) lives in the run's Redis
  # and needs nothing more; torchft's lighthouse runs on the controller VM (replica mode with
  # it and without that VM is refused: the fleet's preconditions).
  lighthouse = local.replica && var.replica_quorum == "lighthouse"
  # The fleet reaches the lighthouse on the controller VM's reserved internal address.
  lighthouse_address = local.lighthouse && var.create_controller ? "${google_compute_address.controller[0].address}:${var.lighthouse_port}" : ""
  # The agent's replica-mode settings (the names of spottrain/protocol/env.py), each line
  # ending in a newline; empty in elastic mode, so an elastic boot script is byte for byte
  # what it was before replica mode existed (no new instance template on upgrade). The
  # lighthouse's address only with that quorum.
  # tests/unit/terraform/replica_values.py reads these lines; change both together.
  # The Redis quorum's settings only with it (the lighthouse has its own, fixed).
  replica_env_lines = local.replica ? join("", [for line in concat([
    "SPOTTRAIN_FAULT_TOLERANCE=\"replica\"",
    "SPOTTRAIN_NODES_PER_REPLICA=\"${var.nodes_per_replica}\"",
    "SPOTTRAIN_MIN_REPLICAS=\"${var.min_replicas}\"",
    "SPOTTRAIN_QUORUM=\"${var.replica_quorum}\"",
    "SPOTTRAIN_MANAGER_PORT=\"${var.manager_port}\"",
  ], local.lighthouse ? ["SPOTTRAIN_LIGHTHOUSE=\"${local.lighthouse_address}\""] : [], local.lighthouse ? [] : [
    "SPOTTRAIN_QUORUM_WAIT_REPLICAS=\"${var.replica_wait_replicas}\"",
    "SPOTTRAIN_QUORUM_HEARTBEAT_TIMEOUT=\"${local.replica_heartbeat_timeout_s}\"",
    "SPOTTRAIN_QUORUM_JOIN_TIMEOUT=\"${local.replica_join_timeout_ms}\"",
    "SPOTTRAIN_QUORUM_RELAY_GROUP=\"${local.replica_relay_group_size}\"",
  ]) : "${line}\n"]) : ""
  # The Redis quorum's join timeout in ms, "auto" resolved as the spec does
  # (spottrain.spec.replica.auto_join_timeout_ms): twice Redis's ~54 µs per replica per round
  # (bench/quorum_scale.py) for the largest fleet, never below 250 ms nor above 60 s.
  replica_join_timeout_ms = var.replica_join_timeout_ms == "auto" ? min(60000, max(250, ceil(2 * floor(var.nnodes_max / var.nodes_per_replica) * 54 / 1000))) : tonumber(var.replica_join_timeout_ms)
  # The Redis quorum's heartbeat timeout in s, "auto" resolved as the spec does
  # (spottrain.spec.heartbeat.auto_heartbeat_timeout_s): the whole half-second at which the
  # replicas' heartbeats (5 per timeout, ~28 µs of Redis each) take at most 35 % of a Redis
  # core, never below 1 s nor above 300 s.
  replica_heartbeat_timeout_s = var.replica_heartbeat_timeout_s == "auto" ? min(300, max(1, ceil(2 * floor(var.nnodes_max / var.nodes_per_replica) * 5 * 28 / 350000) / 2)) : tonumber(var.replica_heartbeat_timeout_s)
  # Replicas per quorum relay, "auto" resolved as the spec does
  # (spottrain.spec.replica.relay_group_size): 100 from 1,000 replicas, else 0 (no relays).
  replica_relay_group_size = var.replica_relay_group_size == "auto" ? (floor(var.nnodes_max / var.nodes_per_replica) >= 1000 ? 100 : 0) : tonumber(var.replica_relay_group_size)
  # torchft, for the workers' managers: a second requirement of the same pinned release,
  # whose extras pip merges with the first's.
  replica_requirement = local.replica ? " 'spottrain[replica]==${var.spottrain_version}'" : ""
  # The framework train.integration trains with (hf, accelerate, lightning: spottrain's
  # extra of the same name, at the versions its tests ran on), a requirement of the same
  # pinned release; empty for sdk and plain, so their boot script is what it was. With an
  # env_lock the lock holds it instead (fleet.tf refuses one that does not).
  # tests/unit/terraform/replica_values.py mirrors it.
  integration_requirement = contains(["hf", "accelerate", "lightning"], var.integration) ? " 'spottrain[${var.integration}]==${var.spottrain_version}'" : ""

  startup_vars = {
    spottrain_version       = var.spottrain_version
    spottrain_requirement   = "spottrain[agent,gcp]==${var.spottrain_version}"
    env_lock                = var.env_lock
    run_id                  = var.run_id
    nfs_fstab_entry         = local.nfs_fstab_entry
    ckpt_dir                = local.ckpt_dir
    code_fetch              = local.code_fetch
    redis_password_secret   = var.redis_password_secret
    secret_env_table        = local.secret_env_table
    redis_url               = var.redis_url
    nnodes                  = "${var.nnodes_min}:${var.nnodes_max}"
    nproc_per_node          = local.nproc_per_node
    expect_gpus             = local.expect_gpus
    ckpt_copy_to            = var.checkpoint_copy_to
    train_cmd_env           = local.train_cmd_env
    replica_env_lines       = local.replica_env_lines
    integration_env_line    = local.integration_env_line
    replica_requirement     = local.replica_requirement
    integration_requirement = local.integration_requirement
  }

  controller_vars = {
    spottrain_version     = var.spottrain_version
    spottrain_requirement = "spottrain[gcp]==${var.spottrain_version}"
    run_id                = var.run_id
    redis_password_secret = var.redis_password_secret
    fault_tolerance       = var.fault_tolerance
    replica_quorum        = var.replica_quorum
    lighthouse_port       = var.lighthouse_port
    # base64, so that no line of the YAML can end the script's heredoc or be read by bash.
    job_spec_b64 = base64encode(var.controller_job_spec)
  }

  # Access scopes only cap what the VM's token may do; the service accounts' IAM roles
  # (iam.tf) are what grant it. Secret Manager has no narrower scope than cloud-platform, so
  # a node that reads a secret (the Redis password, the job's) gets that one, still limited
  # by its roles.
  fleet_scopes = distinct(concat(
    ["https://www.googleapis.com/auth/logging.write"],
    local.copy_bucket != "" ? ["https://www.googleapis.com/auth/devstorage.read_write"] : [],
    local.archive_bucket != "" ? ["https://www.googleapis.com/auth/devstorage.read_only"] : [],
    var.redis_password_secret != "" || length(local.job_secrets) > 0 ? ["https://www.googleapis.com/auth/cloud-platform"] : [],
  ))
}

# The subnetwork's primary range is the only client range the Filestore share is exported to.
data "google_compute_subnetwork" "fleet" {
  project = var.project
  region  = local.region
  name    = var.subnetwork
}
