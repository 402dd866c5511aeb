resource "aws_placement_group" "fleet" {
  count = var.cluster_placement_group ? 1 : 0

  name     = local.name
  strategy = "cluster"
  tags     = local.tags
}

resource "aws_launch_template" "fleet" {
  name                   = local.name
  description            = "spottrain ${var.spottrain_version} agent VMs of run ${var.run_id}"
  image_id               = var.ami_id
  key_name               = var.key_name == "" ? null : var.key_name
  update_default_version = true
  # No instance_market_options: the group's mixed instances policy makes every VM spot.

  # With an env_lock the script is gzipped (cloud-init unpacks it): AWS takes at most 16 KB of
  # user data, and the lock alone can be several.
  user_data = var.env_lock == "" ? base64encode(local.boot_script) : base64gzip(local.boot_script)

  iam_instance_profile {
    arn = aws_iam_instance_profile.agent.arn
  }

  metadata_options {
    http_endpoint = "enabled"
    # IMDSv2 only: a token PUT first, so an SSRF in a training script cannot read the
    # role's credentials with a plain GET.
    http_tokens = "required"
    # 2, not 1: containers on the VM (a job run in docker) sit one hop further away and
    # must still reach the metadata service for the agent's notices and credentials.
    http_put_response_hop_limit = 2
    # The agent and operators read the run's tags from the VM itself, with no
    # ec2:DescribeTags permission.
    instance_metadata_tags = "enabled"
  }

  block_device_mappings {
    device_name = data.aws_ami.fleet.root_device_name

    ebs {
      volume_size           = var.root_volume_size_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  # One interface per network card: EFA on every card for the collectives when the type
  # has EFA; a plain interface otherwise. The subnet comes from the group
  # (vpc_zone_identifier), so one template serves every zone it is allowed.
  dynamic "network_interfaces" {
    for_each = range(var.efa_enabled ? var.efa_interface_count : 1)

    content {
      network_card_index = network_interfaces.value
      # EC2 wants device index 0 for the primary interface and 1 for the EFA interfaces
      # on the other cards.
      device_index          = network_interfaces.value == 0 ? 0 : 1
      interface_type        = var.efa_enabled ? "efa" : null
      security_groups       = [aws_security_group.fleet.id]
      delete_on_termination = true
    }
  }

  dynamic "tag_specifications" {
    for_each = toset(["instance", "volume", "network-interface"])

    content {
      resource_type = tag_specifications.value
      tags          = merge(local.tags, { Name = local.name })
    }
  }

  tags = local.tags

  lifecycle {
    precondition {
      condition     = (var.code_archive_url != "") != (var.git_repo != "")
      error_message = "Give the job's code as exactly one of code_archive_url (with code_archive_sha256) or git_repo (with git_commit)."
    }
    precondition {
      condition     = (var.code_archive_url == "") == (var.code_archive_sha256 == "") && (var.git_repo == "") == (var.git_commit == "")
      error_message = "code_archive_url needs code_archive_sha256, and git_repo needs git_commit (both pin the code every node runs)."
    }
    precondition {
      # AWS takes at most 16 KB of user data, before base64; with an env_lock the script is
      # gzipped (and the lock's own validation keeps it within the limit).
      condition     = var.env_lock != "" || length(local.boot_script) <= 16384
      error_message = "The boot script is ${length(local.boot_script)} characters, over AWS's 16 KB of user data: give fewer secret_env_arns (each adds its name and ARN), or set env_lock (the script is then gzipped)."
    }
    precondition {
      condition     = var.git_token_secret_arn == "" || startswith(var.git_repo, "https://")
      error_message = "git_token_secret_arn works with an https:// git_repo only: an ssh:// repository is read with a deploy key in the AMI, and a code archive needs no token."
    }
    precondition {
      condition     = (var.redis_url != "") != var.create_elasticache
      error_message = "Give exactly one of redis_url (an existing Redis) or create_elasticache = true."
    }
    precondition {
      condition     = !var.create_elasticache || var.redis_password_secret_arn != ""
      error_message = "create_elasticache needs redis_password_secret_arn: the replication group's AUTH token is that secret's value."
    }
    precondition {
      condition     = !local.replica || var.replica_quorum != "lighthouse" || var.create_controller
      error_message = "replica_quorum = \"lighthouse\" needs create_controller = true: the torchft lighthouse, which every replica asks for each step's quorum, runs on the controller VM inside the fleet's VPC; the default replica_quorum = \"redis\" needs no controller VM."
    }
    precondition {
      condition     = var.env_lock == "" || alltrue([for p in lookup({ hf = ["transformers", "accelerate"], accelerate = ["accelerate"], lightning = ["lightning"] }, var.integration, []) : length(regexall("(?m)^${p}==", var.env_lock)) > 0])
      error_message = "env_lock is not a lock for integration = \"${var.integration}\": it lacks the framework that integration trains with (spottrain's ${var.integration} extra: hf needs transformers and accelerate, accelerate needs accelerate, lightning needs lightning), and the VMs install only the lock; make it from the job's spec, whose train.integration is ${var.integration}: spottrain lock JOB.yaml --cloud aws -o FILE."
    }
    precondition {
      condition     = !local.replica || var.integration == "sdk"
      error_message = "integration = \"${var.integration}\" cannot run with fault_tolerance = \"replica\": replica mode drives torchft's manager and its DDP/HSDP wrappers from spottrain's TrainSession, while the Hugging Face Trainer, Accelerate and Lightning own their loops and process groups and a plain script has no step boundary torchft can use: use fault_tolerance = \"elastic\", or integration = \"sdk\"."
    }
    precondition {
      condition     = local.replica || (var.nodes_per_replica == 1 && var.min_replicas == 1 && var.replica_quorum == "redis")
      error_message = "nodes_per_replica (${var.nodes_per_replica}), min_replicas (${var.min_replicas}) and replica_quorum (${var.replica_quorum}) apply only with fault_tolerance = \"replica\": set it, or leave them at 1, 1 and \"redis\"."
    }
    precondition {
      condition     = !local.replica || var.replica_quorum != "lighthouse" || (var.replica_wait_replicas == 0 && var.replica_heartbeat_timeout_s == "auto" && var.replica_join_timeout_ms == "auto" && var.replica_relay_group_size == "auto")
      error_message = "replica_wait_replicas (${var.replica_wait_replicas}), replica_heartbeat_timeout_s (${var.replica_heartbeat_timeout_s}), replica_join_timeout_ms (${var.replica_join_timeout_ms}) and replica_relay_group_size (${var.replica_relay_group_size}) apply to the Redis quorum only: torchft's lighthouse runs with its own fixed settings; leave them at 0, \"auto\", \"auto\" and \"auto\", or use replica_quorum = \"redis\"."
    }
    precondition {
      condition     = var.nodes_min >= var.min_replicas * var.nodes_per_replica
      error_message = "nodes_min (${var.nodes_min}) is below min_replicas x nodes_per_replica (${var.min_replicas} x ${var.nodes_per_replica}): the quorum could never form; raise nodes_min or lower min_replicas."
    }
    precondition {
      condition     = var.nodes_min % var.nodes_per_replica == 0 && var.nodes_max % var.nodes_per_replica == 0
      error_message = "nodes_min (${var.nodes_min}) and nodes_max (${var.nodes_max}) must be multiples of nodes_per_replica (${var.nodes_per_replica}): a partial replica never trains."
    }
    precondition {
      condition     = var.gpus_per_node == 0 || var.nproc_per_node <= var.gpus_per_node
      error_message = "nproc_per_node must not exceed gpus_per_node (one training process per GPU at most)."
    }
  }
}

resource "aws_autoscaling_group" "fleet" {
  name                = local.asg_name
  vpc_zone_identifier = var.subnet_ids
  placement_group     = var.cluster_placement_group ? aws_placement_group.fleet[0].id : null

  min_size         = 0
  max_size         = var.nodes_max
  desired_capacity = local.initial_size
  # Spot capacity can take a long time to appear, or none may exist right now; the
  # controller waits for it, an apply should not.
  wait_for_capacity_timeout = "0"

  # The controller picks which VM leaves (one that has drained, a straggler); the group
  # scaling in on its own would kill a training node without a checkpoint.
  protect_from_scale_in = true
  capacity_rebalance    = var.capacity_rebalance
  # A VM's health is the agent's business (boot health check, heartbeats in Redis): the
  # controller replaces unhealthy VMs, the group only replaces ones EC2 says are broken.
  health_check_type         = "EC2"
  health_check_grace_period = 300

  mixed_instances_policy {
    instances_distribution {
      # All spot: on-demand fallback is the controller's decision (spec spot policy).
      on_demand_base_capacity                  = 0
      on_demand_percentage_above_base_capacity = 0
      # Pools with the lowest interruption risk among the cheap ones, not merely the
      # cheapest: every interruption stalls the whole synchronous job.
      spot_allocation_strategy = "price-capacity-optimized"
    }

    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.fleet.id
        # A pinned version, so a template change shows in the plan; VMs already running
        # keep theirs (no instance refresh: replacing training nodes is the controller's
        # job, and new code or a new agent version means a new run_id).
        version = aws_launch_template.fleet.latest_version
      }

      dynamic "override" {
        for_each = var.instance_types

        content {
          instance_type = override.value
        }
      }
    }
  }

  tag {
    key                 = "spottrain-job"
    value               = var.run_id
    propagate_at_launch = true
  }

  tag {
    key                 = "spottrain-managed-by"
    value               = "terraform"
    propagate_at_launch = true
  }

  tag {
    key                 = "Name"
    value               = local.name
    propagate_at_launch = true
  }

  dynamic "tag" {
    for_each = var.tags

    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }

  # The VMs must be able to fetch their secrets and mount the volume as they boot.
  depends_on = [
    aws_iam_role_policy.agent,
    aws_efs_mount_target.checkpoint,
    aws_vpc_security_group_ingress_rule.checkpoint_from_fleet,
    aws_vpc_security_group_ingress_rule.fleet_from_checkpoint,
  ]

  lifecycle {
    # The spottrain controller owns the group's size once it exists: it backfills
    # preemptions, shrinks on drains and moves the job. An apply that reset
    # desired_capacity would launch or terminate training nodes behind its back.
    ignore_changes = [desired_capacity]

    precondition {
      condition     = var.nodes_min <= var.nodes_max
      error_message = "nodes_min must not exceed nodes_max."
    }
    precondition {
      condition     = local.initial_size <= var.nodes_max
      error_message = "initial_size must not exceed nodes_max."
    }
    precondition {
      condition     = !var.cluster_placement_group || length(local.zones) == 1
      error_message = "A cluster placement group lives in one availability zone: give subnet_ids in one zone, or set cluster_placement_group = false."
    }
  }
}

resource "aws_autoscaling_lifecycle_hook" "drain" {
  name                   = local.lifecycle_hook_name
  autoscaling_group_name = aws_autoscaling_group.fleet.name
  lifecycle_transition   = "autoscaling:EC2_INSTANCE_TERMINATING"
  # The agent sees the Terminated target state in instance metadata, commits an emergency
  # checkpoint, leaves the rendezvous and then completes the action itself; the timeout
  # only matters when the agent is gone, and CONTINUE lets the termination go on then.
  heartbeat_timeout = var.lifecycle_heartbeat_timeout_s
  default_result    = "CONTINUE"
}
