output "spottrain_fleet" {
  description = "The fleet: section of the job spec that makes the spottrain controller adopt this group instead of launching VMs (controller_job_spec_yaml gets it automatically)."
  value       = local.spottrain_fleet
}

output "region" {
  description = "The region of the fleet."
  value       = local.region
}

output "run_id" {
  description = "The run id (the spottrain-job tag of every VM)."
  value       = var.run_id
}

output "asg_name" {
  description = "The Auto Scaling group of the fleet (the fleet section's group)."
  value       = aws_autoscaling_group.fleet.name
}

output "asg_arn" {
  description = "The Auto Scaling group's ARN."
  value       = aws_autoscaling_group.fleet.arn
}

output "lifecycle_hook_name" {
  description = "The termination lifecycle hook the agents complete after their emergency checkpoint (the fleet section's lifecycle_hook)."
  value       = aws_autoscaling_lifecycle_hook.drain.name
}

output "launch_template_id" {
  description = "The fleet's launch template."
  value       = aws_launch_template.fleet.id
}

output "security_group_id" {
  description = "The fleet's security group (all traffic among the VMs only)."
  value       = aws_security_group.fleet.id
}

output "redis_security_group_id" {
  description = "The security group that lets the fleet and the controller reach Redis on redis_port: the ElastiCache group's, and attachable to a Redis of your own."
  value       = aws_security_group.redis.id
}

output "placement_group_name" {
  description = "The cluster placement group (null when cluster_placement_group is off)."
  value       = var.cluster_placement_group ? aws_placement_group.fleet[0].name : null
}

output "checkpoint_filesystem_id" {
  description = "The FSx for Lustre or EFS file system mounted at /mnt/spottrain."
  value       = local.checkpoint_fs.id
}

output "checkpoint_filesystem_dns_name" {
  description = "The checkpoint file system's DNS name."
  value       = local.checkpoint_fs.dns
}

output "checkpoint_filesystem_mount_name" {
  description = "The Lustre mount name (\"/\" for EFS)."
  value       = local.checkpoint_fs.mount
}

output "redis_url" {
  description = "The Redis URL the agents use. It holds no secret (redis_url is validated to carry no credentials; the password stays in Secrets Manager)."
  value       = local.redis_url
}

output "agent_role_arn" {
  description = "The agents' IAM role (to grant it more, e.g. a bucket policy on the checkpoint copies)."
  value       = aws_iam_role.agent.arn
}

output "controller_private_ip" {
  description = "The controller VM's private address (null without create_controller)."
  value       = var.create_controller ? aws_instance.controller[0].private_ip : null
}

output "controller_instance_id" {
  description = "The controller VM (null without create_controller), for `aws ssm start-session --target`."
  value       = var.create_controller ? aws_instance.controller[0].id : null
}

output "lighthouse_address" {
  description = "replica_quorum = \"lighthouse\": where the fleet reaches the torchft lighthouse, the controller VM's private address and lighthouse_port (the agents' SPOTTRAIN_LIGHTHOUSE); null in elastic mode."
  value       = local.lighthouse_address == "" ? null : local.lighthouse_address
}
