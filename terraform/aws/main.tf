data "aws_region" "current" {}

data "aws_partition" "current" {}

data "aws_caller_identity" "current" {}

data "aws_subnet" "fleet" {
  for_each = toset(var.subnet_ids)
  id       = each.value
}

# The GPU AMI, read for its root device name (the root volume mapping must name it exactly,
# or EC2 adds a second volume instead of resizing the root one).
data "aws_ami" "fleet" {
  filter {
    name   = "image-id"
    values = [var.ami_id]
  }
}

locals {
  # Names are computed from run_id, never read back from the resources: the launch
  # template's user data carries the group's name, and the group refers to the template,
  # so reading aws_autoscaling_group.fleet.name there would be a dependency cycle.
  name                = "spottrain-${var.run_id}"
  asg_name            = local.name
  lifecycle_hook_name = "${local.name}-drain"

  region     = data.aws_region.current.name
  partition  = data.aws_partition.current.partition
  account_id = data.aws_caller_identity.current.account_id

  vpc_id = data.aws_subnet.fleet[var.subnet_ids[0]].vpc_id
  zones  = distinct([for id in var.subnet_ids : data.aws_subnet.fleet[id].availability_zone])
  # One subnet per zone: EFS takes a single mount target per zone.
  subnet_per_zone = { for id in var.subnet_ids : data.aws_subnet.fleet[id].availability_zone => id... }

  initial_size = var.initial_size == null ? var.nodes_max : var.initial_size

  redis_subnet_ids = length(var.elasticache_subnet_ids) > 0 ? var.elasticache_subnet_ids : var.subnet_ids

  # The group's ARN as IAM sees it, built from the name (the group's id is random), so the
  # agents' policy exists before the group launches its first VM.
  asg_arn = "arn:${local.partition}:autoscaling:${local.region}:${local.account_id}:autoScalingGroup:*:autoScalingGroupName/${local.asg_name}"

  tags = merge(var.tags, {
    # TAG_JOB in spottrain/cloud/base.py: the controller finds and adopts the VMs by it.
    "spottrain-job"        = var.run_id
    "spottrain-managed-by" = "terraform"
  })

  # --- checkpoint copies and code in S3 ------------------------------------------------------
  copy_to     = trimsuffix(var.checkpoint_copy_to, "/")
  copy_bucket = local.copy_to == "" ? "" : regex("^s3://([^/]+)", local.copy_to)[0]
  copy_prefix = local.copy_to == "" ? "" : trimprefix(trimprefix(local.copy_to, "s3://${local.copy_bucket}"), "/")
  # Agents copy their checkpoints to <copy_to>/<run id>/ (agent/checkpoint/copy.py): the VMs may
  # write there and nowhere else in the bucket.
  copy_run_objects = local.copy_to == "" ? "" : (
    "arn:${local.partition}:s3:::${local.copy_bucket}/${local.copy_prefix == "" ? "" : "${local.copy_prefix}/"}${var.run_id}/*"
  )
  copy_prefix_objects = local.copy_to == "" ? "" : (
    "arn:${local.partition}:s3:::${local.copy_bucket}/${local.copy_prefix == "" ? "*" : "${local.copy_prefix}/*"}"
  )
  code_archive_object = var.code_archive_url == "" ? "" : "arn:${local.partition}:s3:::${trimprefix(var.code_archive_url, "s3://")}"

  # --- the shared checkpoint volume, as /etc/fstab sees it ------------------------------------
  fsx = var.checkpoint_filesystem == "fsx-lustre"
  checkpoint_fs = local.fsx ? {
    id     = aws_fsx_lustre_file_system.checkpoint[0].id
    dns    = aws_fsx_lustre_file_system.checkpoint[0].dns_name
    mount  = aws_fsx_lustre_file_system.checkpoint[0].mount_name
    type   = "lustre"
    source = "${aws_fsx_lustre_file_system.checkpoint[0].dns_name}@tcp:/${aws_fsx_lustre_file_system.checkpoint[0].mount_name}"
    # flock: the checkpoint commit relies on POSIX locks and atomic renames across nodes.
    options = "defaults,relatime,flock,_netdev,x-systemd.requires=network-online.target"
    } : {
    id    = aws_efs_file_system.checkpoint[0].id
    dns   = aws_efs_file_system.checkpoint[0].dns_name
    mount = "/"
    type  = "nfs4"
    # AWS's recommended NFS options for EFS; `hard` so a slow server delays a checkpoint
    # instead of corrupting it.
    source  = "${aws_efs_file_system.checkpoint[0].dns_name}:/"
    options = "nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport,_netdev"
  }

  # --- Redis ----------------------------------------------------------------------------------
  redis_url = var.create_elasticache ? (
    "rediss://${aws_elasticache_replication_group.redis[0].primary_endpoint_address}:${var.redis_port}"
  ) : var.redis_url
  redis_password_file = var.redis_password_secret_arn == "" ? "" : "/etc/spottrain/redis-password"

  # --- the job's secrets, read at boot -------------------------------------------------------
  # The ARNs the agents' role may read besides the Redis password: train.secret_env's and
  # the git token's, exactly these.
  job_secret_arns = distinct(concat(values(var.secret_env_arns), var.git_token_secret_arn == "" ? [] : [var.git_token_secret_arn]))
  # train.secret_env as the boot script's table, one "NAME ARN" line each (both validated
  # to hold no space or quote), each ending in a newline; empty without secrets.
  # tests/unit/terraform/test_terraform_aws.py mirrors this expression; change both together.
  secret_env_table = join("", [for name, arn in var.secret_env_arns : "${name} ${arn}\n"])

  # --- the training command as SPOTTRAIN_TRAIN_CMD --------------------------------------------
  # The agent splits the value like a POSIX shell (shlex.split), so each argument goes in
  # single quotes, with a ' inside written as '\''. The environment file then wraps the
  # value in double quotes, inside which systemd unescapes only \\ and \".
  # tests/unit/terraform/test_terraform_aws.py mirrors these two expressions; change both together.
  train_command_shell = join(" ", [for a in var.train_command : "'${replace(a, "'", "'\\''")}'"])
  train_command_env   = replace(replace(local.train_command_shell, "\\", "\\\\"), "\"", "\\\"")

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
  # The fleet reaches the lighthouse on the controller VM's private address.
  lighthouse_address = local.lighthouse && var.create_controller ? "${aws_instance.controller[0].private_ip}:${var.lighthouse_port}" : ""
  # The agent's replica-mode settings (the names of spottrain/protocol/env.py), each line
  # ending in a newline; empty in elastic mode, so an elastic boot script is byte for byte
  # what it was before replica mode existed (no new launch template version on upgrade). The
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
  replica_join_timeout_ms = var.replica_join_timeout_ms == "auto" ? min(60000, max(250, ceil(2 * floor(var.nodes_max / var.nodes_per_replica) * 54 / 1000))) : tonumber(var.replica_join_timeout_ms)
  # The Redis quorum's heartbeat timeout in s, "auto" resolved as the spec does
  # (spottrain.spec.heartbeat.auto_heartbeat_timeout_s): the whole half-second at which the
  # replicas' heartbeats (5 per timeout, ~28 µs of Redis each) take at most 35 % of a Redis
  # core, never below 1 s nor above 300 s.
  replica_heartbeat_timeout_s = var.replica_heartbeat_timeout_s == "auto" ? min(300, max(1, ceil(2 * floor(var.nodes_max / var.nodes_per_replica) * 5 * 28 / 350000) / 2)) : tonumber(var.replica_heartbeat_timeout_s)
  # Replicas per quorum relay, "auto" resolved as the spec does
  # (spottrain.spec.replica.relay_group_size): 100 from 1,000 replicas, else 0 (no relays).
  replica_relay_group_size = var.replica_relay_group_size == "auto" ? (floor(var.nodes_max / var.nodes_per_replica) >= 1000 ? 100 : 0) : tonumber(var.replica_relay_group_size)
  # torchft, for the workers' managers: a second requirement of the same pinned release,
  # whose extras pip merges with the first's.
  replica_requirement = local.replica ? " 'spottrain[replica]==${var.spottrain_version}'" : ""
  # The framework train.integration trains with (hf, accelerate, lightning: spottrain's
  # extra of the same name, at the versions its tests ran on), a requirement of the same
  # pinned release; empty for sdk and plain, so their boot script is what it was. With an
  # env_lock the lock holds it instead (fleet.tf refuses one that does not).
  # tests/unit/terraform/replica_values.py mirrors it.
  integration_requirement = contains(["hf", "accelerate", "lightning"], var.integration) ? " 'spottrain[${var.integration}]==${var.spottrain_version}'" : ""

  # Every placeholder of boot.sh.tftpl. Values in single quotes in the script are
  # validated to hold no quote; the template chooses between code sources and mounts with
  # plain bash, so it needs no template directives.
  boot_script = templatefile("${path.module}/boot.sh.tftpl", local.boot_template_values)
  boot_template_values = {
    spottrain_version       = var.spottrain_version
    env_lock                = var.env_lock
    run_id                  = var.run_id
    region                  = local.region
    redis_url               = local.redis_url
    redis_password_secret   = var.redis_password_secret_arn
    redis_password_file     = local.redis_password_file
    checkpoint_fs_type      = local.checkpoint_fs.type
    checkpoint_fs_source    = local.checkpoint_fs.source
    checkpoint_fs_options   = local.checkpoint_fs.options
    checkpoint_copy_to      = local.copy_to
    code_archive_url        = var.code_archive_url
    code_archive_sha256     = var.code_archive_sha256
    git_repo                = var.git_repo
    git_commit              = var.git_commit
    git_token_secret        = var.git_token_secret_arn
    git_token_user          = var.git_token_user
    secret_env_table        = local.secret_env_table
    nnodes                  = "${var.nodes_min}:${var.nodes_max}"
    nproc_per_node          = var.nproc_per_node
    expect_gpus             = var.gpus_per_node
    train_command           = local.train_command_env
    asg_name                = local.asg_name
    lifecycle_hook_name     = local.lifecycle_hook_name
    replica_env_lines       = local.replica_env_lines
    integration_env_line    = local.integration_env_line
    replica_requirement     = local.replica_requirement
    integration_requirement = local.integration_requirement
  }

  # The fleet: section of a job spec that adopts this fleet instead of launching VMs.
  spottrain_fleet = {
    managed_by     = "terraform"
    cloud          = "aws"
    region         = local.region
    group          = local.asg_name
    lifecycle_hook = local.lifecycle_hook_name
    run_id         = var.run_id
  }
}
