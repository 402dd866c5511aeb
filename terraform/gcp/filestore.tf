# The checkpoint volume every node mounts at /mnt/spottrain: one share for the whole fleet, so
# a backfilled node restores what the others committed, and fast enough that an emergency
# checkpoint fits in GCP's 30-second preemption notice.
resource "google_filestore_instance" "ckpt" {
  project     = var.project
  name        = local.name
  location    = var.zone
  tier        = var.filestore_tier
  description = "spottrain checkpoints of run ${var.run_id}"
  labels      = local.labels

  file_shares {
    name        = var.filestore_share_name
    capacity_gb = var.filestore_capacity_gb

    # Exported to the fleet's subnetwork only, read-write. No root squash: the agent and the
    # trainers run as root and must own what they write.
    nfs_export_options {
      ip_ranges   = [data.google_compute_subnetwork.fleet.ip_cidr_range]
      access_mode = "READ_WRITE"
      squash_mode = "NO_ROOT_SQUASH"
    }
  }

  networks {
    network      = var.network
    modes        = ["MODE_IPV4"]
    connect_mode = "DIRECT_PEERING"
  }

  lifecycle {
    precondition {
      condition     = var.filestore_capacity_gb >= local.filestore_min_gb[var.filestore_tier]
      error_message = "filestore_capacity_gb: ${var.filestore_tier} needs at least ${local.filestore_min_gb[var.filestore_tier]} GiB."
    }
    precondition {
      condition     = var.filestore_tier != "BASIC_SSD" || var.filestore_capacity_gb <= 65434
      error_message = "filestore_capacity_gb: BASIC_SSD holds at most 65434 GiB; use ZONAL or HIGH_SCALE_SSD for more."
    }
  }
}
