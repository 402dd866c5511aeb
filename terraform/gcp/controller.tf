# An optional small on-demand VM for the spottrain controller. On-demand on purpose: the
# controller is what replaces preempted nodes, so it must not be preempted itself.
resource "google_compute_instance" "controller" {
  count        = var.create_controller ? 1 : 0
  project      = var.project
  zone         = var.zone
  name         = "${local.name}-controller"
  description  = "spottrain controller of run ${var.run_id} (managed by terraform/gcp)"
  machine_type = var.controller_machine_type
  # Not the fleet's labels: a VM labelled spottrain-job would be counted as a node.
  labels = local.controller_labels
  # Its own tag, which the Redis rule admits; it needs no port on the nodes.
  tags = [local.controller_tag]

  boot_disk {
    auto_delete = true
    initialize_params {
      image  = var.controller_image
      size   = 20
      type   = "pd-balanced"
      labels = local.controller_labels
    }
  }

  network_interface {
    network            = var.network
    subnetwork         = var.subnetwork
    subnetwork_project = var.project
    # The lighthouse quorum: the reserved address the fleet's agents reach the lighthouse at.
    network_ip = local.lighthouse ? google_compute_address.controller[0].address : null

    dynamic "access_config" {
      for_each = var.external_ip ? [1] : []
      content {
        network_tier = "PREMIUM"
      }
    }
  }

  scheduling {
    provisioning_model  = "STANDARD"
    preemptible         = false
    automatic_restart   = true
    on_host_maintenance = "MIGRATE"
  }

  # The controller calls the Compute, Storage and Secret Manager APIs: cloud-platform, capped
  # by the account's roles (iam.tf).
  service_account {
    email  = google_service_account.controller[0].email
    scopes = ["https://www.googleapis.com/auth/cloud-platform"]
  }

  # No GPU driver to load, so Secure Boot costs nothing here.
  shielded_instance_config {
    enable_secure_boot          = true
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    startup-script         = templatefile("${path.module}/controller.sh.tftpl", local.controller_vars)
    enable-oslogin         = "TRUE"
    block-project-ssh-keys = "TRUE"
  }

  # A new machine type stops and starts this VM in place instead of failing the apply. A new
  # startup script is updated in place too and runs at the next boot; it never recreates a
  # controller that is driving a run.
  allow_stopping_for_update = true

  depends_on = [
    google_project_iam_member.controller,
    google_secret_manager_secret_iam_member.controller_redis_password,
    google_storage_bucket_iam_member.controller_ckpt_copy,
  ]

  lifecycle {
    # The workers' integration is the agent's (integration): the spec's must be the same.
    precondition {
      condition     = var.controller_job_spec == "" || try(yamldecode(var.controller_job_spec).train.integration, "sdk") == var.integration
      error_message = "controller_job_spec: its train.integration must match integration (${var.integration}); change whichever is wrong."
    }

    # The controller runs the spec while the nodes boot from these variables: a spec in
    # another mode would drive a fleet that trains differently from what it plans for.
    precondition {
      condition = var.controller_job_spec == "" || (
        try(yamldecode(var.controller_job_spec).train.fault_tolerance, "elastic") == var.fault_tolerance &&
        try(yamldecode(var.controller_job_spec).train.replica.nodes_per_replica, 1) == var.nodes_per_replica &&
        try(yamldecode(var.controller_job_spec).train.replica.min_replicas, 1) == var.min_replicas &&
        try(yamldecode(var.controller_job_spec).train.replica.quorum, "redis") == var.replica_quorum &&
        try(yamldecode(var.controller_job_spec).train.replica.wait_replicas, 0) == var.replica_wait_replicas &&
        # "auto" on both sides, or the same number (the spec's 5 is tfvars' "5" or "5.0"); with
        # the lighthouse (no timeout here) the spec may spell out its own fixed 1 s.
        (
          try(tostring(yamldecode(var.controller_job_spec).train.replica.heartbeat_timeout_s), "auto") == var.replica_heartbeat_timeout_s ||
          try(tonumber(yamldecode(var.controller_job_spec).train.replica.heartbeat_timeout_s) == tonumber(var.replica_heartbeat_timeout_s), false) ||
          (var.replica_quorum == "lighthouse" && var.replica_heartbeat_timeout_s == "auto" && try(tonumber(yamldecode(var.controller_job_spec).train.replica.heartbeat_timeout_s) == 1, false))
        ) &&
        try(tostring(yamldecode(var.controller_job_spec).train.replica.join_timeout_ms), "auto") == var.replica_join_timeout_ms &&
        try(tostring(yamldecode(var.controller_job_spec).train.replica.relay_group_size), "auto") == var.replica_relay_group_size
      )
      error_message = "controller_job_spec: its train.fault_tolerance and train.replica must match fault_tolerance (${var.fault_tolerance}), nodes_per_replica (${var.nodes_per_replica}), min_replicas (${var.min_replicas}), replica_quorum (${var.replica_quorum}), replica_wait_replicas (${var.replica_wait_replicas}), replica_heartbeat_timeout_s (${var.replica_heartbeat_timeout_s}), replica_join_timeout_ms (${var.replica_join_timeout_ms}) and replica_relay_group_size (${var.replica_relay_group_size}); change whichever is wrong."
    }
  }
}

# The lighthouse quorum: the controller VM's internal address, reserved so that the
# lighthouse stays where the nodes' environment files say it is when the VM is recreated (a
# new image).
resource "google_compute_address" "controller" {
  count = local.lighthouse && var.create_controller ? 1 : 0

  project      = var.project
  region       = local.region
  name         = "${local.name}-controller"
  description  = "spottrain run ${var.run_id}: the controller VM, where the fleet reaches the lighthouse"
  address_type = "INTERNAL"
  subnetwork   = data.google_compute_subnetwork.fleet.self_link
}
