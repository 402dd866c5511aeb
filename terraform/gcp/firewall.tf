# Between fleet members, everything: torchrun's workers, NCCL and gloo pick their ports at
# run time (and NCCL opens many), and in replica mode torchft's managers, cross-replica
# process groups and live state transfers (an HTTP server on a random port) add more, so no
# fixed port list would do. Tag to tag, never a range:
# nothing outside the fleet gains access through this rule.
resource "google_compute_firewall" "fleet_internal" {
  project     = var.project
  name        = "${local.name}-fleet"
  network     = var.network
  description = "spottrain run ${var.run_id}: collectives between fleet members"
  direction   = "INGRESS"
  priority    = 1000

  source_tags = [local.fleet_tag]
  target_tags = [local.fleet_tag]

  allow {
    protocol = "all"
  }
}

# The job's Redis (rendezvous, node records, drain requests), on the hosts that serve it, from
# the fleet, this module's controller VM and the listed controller ranges only. The ranges are
# validated never to include the internet (variables.tf).
resource "google_compute_firewall" "redis" {
  project     = var.project
  name        = "${local.name}-redis"
  network     = var.network
  description = "spottrain run ${var.run_id}: Redis from the fleet and its controllers"
  direction   = "INGRESS"
  priority    = 1000

  source_tags   = var.create_controller ? [local.fleet_tag, local.controller_tag] : [local.fleet_tag]
  source_ranges = var.controller_cidrs
  target_tags   = var.redis_target_tags

  allow {
    protocol = "tcp"
    ports    = [tostring(var.redis_port)]
  }

  lifecycle {
    # The rule opens redis_port; a URL naming another port means the fleet could not connect.
    precondition {
      condition     = tonumber(regex("^rediss?://[^/]+:([0-9]+)", var.redis_url)[0]) == var.redis_port
      error_message = "redis_port (${var.redis_port}) is not the port in redis_url (${var.redis_url})."
    }
  }
}

# The lighthouse quorum: every replica's manager asks the lighthouse on the controller VM for
# each step's quorum and heartbeats to it. From fleet members only (the lighthouse has no
# authentication); nothing else on the controller VM is opened. The Redis quorum needs no
# rule: the fleet reaches the run's Redis already.
resource "google_compute_firewall" "lighthouse" {
  count = local.lighthouse && var.create_controller ? 1 : 0

  project     = var.project
  name        = "${local.name}-lighthouse"
  network     = var.network
  description = "spottrain run ${var.run_id}: the torchft lighthouse from the fleet"
  direction   = "INGRESS"
  priority    = 1000

  source_tags = [local.fleet_tag]
  target_tags = [local.controller_tag]

  allow {
    protocol = "tcp"
    ports    = [tostring(var.lighthouse_port)]
  }
}
