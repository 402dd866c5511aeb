output "group_name" {
  description = "Name of the zonal managed instance group of the fleet (the controller resizes it and deletes drained members from it)."
  value       = google_compute_instance_group_manager.fleet.name
}

output "instance_template" {
  description = "The instance template the group creates nodes from."
  value       = google_compute_instance_template.fleet.self_link_unique
}

output "zone" {
  description = "Zone of the fleet, its Filestore and the controller VM."
  value       = var.zone
}

output "project" {
  description = "Project of the fleet."
  value       = var.project
}

output "run_id" {
  description = "The run id: the spottrain-job label of every node and SPOTTRAIN_RUN_ID of every agent."
  value       = var.run_id
}

output "filestore_ip" {
  description = "IP address of the Filestore instance holding the checkpoints."
  value       = local.filestore_ip
}

output "filestore_share" {
  description = "NFS export of the checkpoint share (IP:/share), mounted at /mnt/spottrain on every node."
  value       = local.filestore_export
}

output "checkpoint_dir" {
  description = "This run's checkpoint directory on every node (SPOTTRAIN_CKPT_DIR)."
  value       = local.ckpt_dir
}

output "firewall_names" {
  description = "Firewall rules of the fleet: all traffic between members, Redis from the fleet and its controllers, and in replica mode the lighthouse from the fleet."
  value       = concat([google_compute_firewall.fleet_internal.name, google_compute_firewall.redis.name], google_compute_firewall.lighthouse[*].name)
}

output "fleet_service_account" {
  description = "Service account the nodes run as."
  value       = google_service_account.fleet.email
}

output "controller_internal_ip" {
  description = "Internal IP of the controller VM, or null when create_controller is false."
  value       = var.create_controller ? google_compute_instance.controller[0].network_interface[0].network_ip : null
}

# What a job spec's `fleet:` section names so that the controller adopts this fleet instead of
# launching its own VMs.
output "spottrain_fleet" {
  description = "The job spec's fleet section for this fleet: managed_by, cloud, project, zone, group, run_id."
  value = {
    managed_by = "terraform"
    cloud      = "gcp"
    project    = var.project
    zone       = var.zone
    group      = google_compute_instance_group_manager.fleet.name
    run_id     = var.run_id
  }
}

output "lighthouse_address" {
  description = "replica_quorum = \"lighthouse\": where the nodes reach the torchft lighthouse, the controller VM's reserved internal address and lighthouse_port (the agents' SPOTTRAIN_LIGHTHOUSE); null in elastic mode."
  value       = local.lighthouse_address == "" ? null : local.lighthouse_address
}
