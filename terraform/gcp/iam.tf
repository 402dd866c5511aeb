# One service account per run for the nodes, holding only what a node does: write its logs,
# read the Redis password and the job's secrets, copy checkpoints to (and restore from) one bucket, read the code
# archive. Nothing project-wide beyond logging.
resource "google_service_account" "fleet" {
  project = var.project
  # Account ids are 6-30 characters: a hash of the run id fits where the run id may not.
  account_id   = "spottrain-${substr(sha1(var.run_id), 0, 12)}"
  display_name = "spottrain nodes of run ${var.run_id}"
  description  = "Spot training nodes of spottrain run ${var.run_id} (terraform/gcp)"
}

resource "google_project_iam_member" "fleet_log_writer" {
  project = var.project
  role    = "roles/logging.logWriter"
  member  = "serviceAccount:${google_service_account.fleet.email}"
}

resource "google_secret_manager_secret_iam_member" "fleet_redis_password" {
  count     = var.redis_password_secret != "" ? 1 : 0
  project   = var.project
  secret_id = var.redis_password_secret
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.fleet.email}"
}

# The job's secrets (secret_env, git_token_secret), which the startup script reads into
# root-only files at every boot: exactly these, one binding each.
resource "google_secret_manager_secret_iam_member" "fleet_job_secrets" {
  for_each  = local.job_secrets
  project   = var.project
  secret_id = each.value
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.fleet.email}"
}

# objectAdmin, not objectCreator: replacing a checkpoint copy deletes its MANIFEST.json first
# (cloud/storage/sync.py's upload_dir), and a restore lists and reads the copies. Only under this
# run's prefix: a node of one run must not overwrite or delete another run's checkpoints in a
# shared bucket. Objects are matched by name; a list (a bucket-level call) by the prefix it
# asks for, which the agent always gives (only a list has that attribute, and the run's
# prefix is never empty). IAM conditions need uniform bucket-level access on the bucket.
resource "google_storage_bucket_iam_member" "fleet_ckpt_copy" {
  count  = local.copy_bucket != "" ? 1 : 0
  bucket = local.copy_bucket
  role   = "roles/storage.objectAdmin"
  member = "serviceAccount:${google_service_account.fleet.email}"

  condition {
    title       = "spottrain-run-${substr(sha1(var.run_id), 0, 12)}"
    description = "Checkpoint copies of spottrain run ${var.run_id} only"
    expression  = "resource.name.startsWith(\"projects/_/buckets/${local.copy_bucket}/objects/${local.copy_run_prefix}\") || api.getAttribute(\"storage.googleapis.com/objectListPrefix\", \"\").startsWith(\"${local.copy_run_prefix}\")"
  }
}

resource "google_storage_bucket_iam_member" "fleet_code_archive" {
  count  = local.archive_bucket != "" ? 1 : 0
  bucket = local.archive_bucket
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.fleet.email}"
}

# The controller VM's account. It lists the run's instances, resizes the group and deletes
# drained members (compute.instanceAdmin.v1: there is no narrower predefined role for
# instance-group management, and listing instances by label needs the project), reads the
# Redis password, uploads code archives and moves checkpoint copies in the copy bucket.
resource "google_service_account" "controller" {
  count        = var.create_controller ? 1 : 0
  project      = var.project
  account_id   = "spottrain-ctl-${substr(sha1(var.run_id), 0, 12)}"
  display_name = "spottrain controller of run ${var.run_id}"
  description  = "Controller VM of spottrain run ${var.run_id} (terraform/gcp)"
}

# roles/compute.instanceAdmin.v1 includes compute.instances.getSerialPortOutput: the controller
# reads a VM's serial port 1 for the boot's failure line when the VM never came up healthy.
resource "google_project_iam_member" "controller" {
  for_each = var.create_controller ? toset(["roles/compute.instanceAdmin.v1", "roles/logging.logWriter"]) : toset([])
  project  = var.project
  role     = each.value
  member   = "serviceAccount:${google_service_account.controller[0].email}"
}

# Launching VMs that run as the nodes' account (on-demand fallback outside the group) needs
# actAs on that one account, not on every account of the project.
resource "google_service_account_iam_member" "controller_acts_as_fleet" {
  count              = var.create_controller ? 1 : 0
  service_account_id = google_service_account.fleet.name
  role               = "roles/iam.serviceAccountUser"
  member             = "serviceAccount:${google_service_account.controller[0].email}"
}

resource "google_secret_manager_secret_iam_member" "controller_redis_password" {
  count     = var.create_controller && var.redis_password_secret != "" ? 1 : 0
  project   = var.project
  secret_id = var.redis_password_secret
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.controller[0].email}"
}

resource "google_storage_bucket_iam_member" "controller_ckpt_copy" {
  count  = var.create_controller && local.copy_bucket != "" ? 1 : 0
  bucket = local.copy_bucket
  role   = "roles/storage.objectAdmin"
  member = "serviceAccount:${google_service_account.controller[0].email}"
}
