resource "google_compute_instance_template" "fleet" {
  project = var.project
  # Templates are immutable: every change makes a new one, created before the old one is
  # deleted so that the group always references an existing template.
  name_prefix = "${local.name}-"
  description = "spottrain spot node of run ${var.run_id} (managed by terraform/gcp)"

  # A3 and A2 types come with their GPUs attached, so there is no guest_accelerator block:
  # it is only for N1 VMs, which take GPUs separately, and this module offers none.
  machine_type = var.machine_type
  labels       = local.labels
  # Fleet members reach each other on every port (firewall.tf) through this tag.
  tags = [local.fleet_tag]

  scheduling {
    provisioning_model = "SPOT"
    # The provider requires preemptible and no automatic restart with SPOT; a spot VM can
    # neither migrate live nor restart itself, so host maintenance terminates it.
    preemptible         = true
    automatic_restart   = false
    on_host_maintenance = "TERMINATE"
    # The MIG recreates a preempted member in either case (same name, fresh boot disk, the
    # latest template: see instance_lifecycle_policy). STOP is the default because the stopped
    # VM stays listed with its labels until then, so the controller, even one restarted in
    # between, sees a preemption rather than a node that vanished; DELETE frees the boot disk
    # sooner and leaves the controller only the zone's preemption operations to tell.
    instance_termination_action = var.termination_action
  }

  disk {
    source_image = var.image
    disk_size_gb = var.boot_disk_gb
    disk_type    = local.boot_disk_type
    boot         = true
    auto_delete  = true
    labels       = local.labels
  }

  network_interface {
    network            = var.network
    subnetwork         = var.subnetwork
    subnetwork_project = var.project
    nic_type           = local.nic_type

    dynamic "access_config" {
      for_each = var.external_ip ? [1] : []
      content {
        network_tier = "PREMIUM"
      }
    }
  }

  service_account {
    email  = google_service_account.fleet.email
    scopes = local.fleet_scopes
  }

  shielded_instance_config {
    enable_secure_boot          = var.secure_boot
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    startup-script = templatefile("${path.module}/startup.sh.tftpl", local.startup_vars)
    # SSH through IAM (OS Login) instead of keys in metadata that outlive the people who added
    # them; no firewall rule here admits SSH at all (add IAP's range yourself if needed).
    enable-oslogin         = "TRUE"
    block-project-ssh-keys = "TRUE"
  }

  lifecycle {
    create_before_destroy = true

    precondition {
      condition = (
        (var.code_archive_url != "" && var.code_archive_sha256 != "" && var.git_repo == "" && var.git_commit == "" && var.git_subdir == "") ||
        (var.code_archive_url == "" && var.code_archive_sha256 == "" && var.git_repo != "" && var.git_commit != "")
      )
      error_message = "Give the job's code one way: code_archive_url with code_archive_sha256, or git_repo with git_commit (and optionally git_subdir)."
    }
    precondition {
      condition     = var.git_token_secret == "" || startswith(var.git_repo, "https://")
      error_message = "git_token_secret works with an https:// git_repo only: an ssh:// repository is read with a deploy key in the image, and a code archive needs no token."
    }
    precondition {
      condition     = var.nnodes_min <= var.nnodes_max
      error_message = "nnodes_min (${var.nnodes_min}) is above nnodes_max (${var.nnodes_max})."
    }
    precondition {
      condition     = !local.replica || var.replica_quorum != "lighthouse" || var.create_controller
      error_message = "replica_quorum = \"lighthouse\" needs create_controller = true: the torchft lighthouse, which every replica asks for each step's quorum, runs on the controller VM inside the fleet's network; the default replica_quorum = \"redis\" needs no controller VM."
    }
    precondition {
      condition     = var.env_lock == "" || alltrue([for p in lookup({ hf = ["transformers", "accelerate"], accelerate = ["accelerate"], lightning = ["lightning"] }, var.integration, []) : length(regexall("(?m)^${p}==", var.env_lock)) > 0])
      error_message = "env_lock is not a lock for integration = \"${var.integration}\": it lacks the framework that integration trains with (spottrain's ${var.integration} extra: hf needs transformers and accelerate, accelerate needs accelerate, lightning needs lightning), and the VMs install only the lock; make it from the job's spec, whose train.integration is ${var.integration}: spottrain lock JOB.yaml --cloud gcp -o FILE."
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
      condition     = var.nnodes_min >= var.min_replicas * var.nodes_per_replica
      error_message = "nnodes_min (${var.nnodes_min}) is below min_replicas x nodes_per_replica (${var.min_replicas} x ${var.nodes_per_replica}): the quorum could never form; raise nnodes_min or lower min_replicas."
    }
    precondition {
      condition     = var.nnodes_min % var.nodes_per_replica == 0 && var.nnodes_max % var.nodes_per_replica == 0
      error_message = "nnodes_min (${var.nnodes_min}) and nnodes_max (${var.nnodes_max}) must be multiples of nodes_per_replica (${var.nodes_per_replica}): a partial replica never trains."
    }
    precondition {
      condition     = var.initial_size <= var.nnodes_max
      error_message = "initial_size (${var.initial_size}) is above nnodes_max (${var.nnodes_max}): the extra nodes could never join the training."
    }
  }
}

# Zonal, not regional: synchronous training keeps all its nodes in one zone (a regional group
# spreads them over several, and the collectives would cross zones), and the Filestore tiers
# offered here are zonal. Moving the job to another zone is the controller's decision, made
# with a checkpoint copied to object storage, not the group's.
resource "google_compute_instance_group_manager" "fleet" {
  project            = var.project
  zone               = var.zone
  name               = local.name
  description        = "spottrain fleet of run ${var.run_id}; its size belongs to the spottrain controller"
  base_instance_name = local.name

  version {
    name              = "primary"
    instance_template = google_compute_instance_template.fleet.self_link_unique
  }

  # The starting size only. The spottrain controller owns the size from then on: it resizes
  # the group to backfill, and removes one drained node with deleteInstances (which also
  # lowers the target). Terraform must not undo either on the next apply.
  target_size = var.initial_size

  # Spot capacity can take hours to appear; an apply that waited for it would time out.
  wait_for_instances = false

  # A new template never replaces a node that is training: a replaced node loses its work
  # since the last checkpoint and makes every other node re-form. OPPORTUNISTIC applies the
  # new template only to VMs the group creates anyway (backfill, preemption repair), or when
  # an operator applies it explicitly; then RECREATE keeps the instance name the controller
  # knows the node by, which needs max_surge 0.
  update_policy {
    type                           = "OPPORTUNISTIC"
    minimal_action                 = "REPLACE"
    most_disruptive_allowed_action = "REPLACE"
    replacement_method             = "RECREATE"
    max_surge_fixed                = 0
    max_unavailable_fixed          = 1
  }

  # A preempted member comes back from the latest template rather than the one it was made
  # from. No health-check autohealing: a node that is slow or re-forming is the controller's
  # to judge, and recreating it would throw away a live training process.
  instance_lifecycle_policy {
    default_action_on_failure = "REPAIR"
    force_update_on_repair    = "YES"
  }

  # No autoscaler either: its scaling signals (CPU, load balancing) mean nothing for training,
  # and it would fight the controller over the size.

  # Nodes boot straight into reading their secrets and the code archive.
  depends_on = [
    google_project_iam_member.fleet_log_writer,
    google_secret_manager_secret_iam_member.fleet_redis_password,
    google_secret_manager_secret_iam_member.fleet_job_secrets,
    google_storage_bucket_iam_member.fleet_ckpt_copy,
    google_storage_bucket_iam_member.fleet_code_archive,
  ]

  lifecycle {
    ignore_changes = [target_size]
  }
}
