# The shared checkpoint volume every VM mounts at /mnt/spottrain (the agent's unit has
# RequiresMountsFor=/mnt/spottrain, so a VM whose mount failed never joins the job). The
# emergency checkpoint must reach it within the 2-minute spot notice: size it for the
# job's aggregate write bandwidth (`spottrain validate` checks the fit).

# FSx for Lustre: the fastest option, in one zone: the first subnet's, which is the cluster
# placement group's. A job that moves zones restores from checkpoint_copy_to.
resource "aws_fsx_lustre_file_system" "checkpoint" {
  count = local.fsx ? 1 : 0

  deployment_type             = var.fsx_deployment_type
  storage_type                = "SSD"
  storage_capacity            = var.fsx_storage_capacity_gib
  per_unit_storage_throughput = var.fsx_deployment_type == "PERSISTENT_2" ? var.fsx_per_unit_storage_throughput : null
  subnet_ids                  = [var.subnet_ids[0]]
  security_group_ids          = [aws_security_group.checkpoint.id]
  # Tensors barely compress, and LZ4 would spend the servers' CPU during the one write
  # that has a deadline.
  data_compression_type = "NONE"
  tags                  = merge(local.tags, { Name = "${local.name}-checkpoint" })
}

# EFS: multi-zone and elastic throughput (it follows the bursts of checkpointing without
# provisioning), slower than Lustre for one large emergency checkpoint.
resource "aws_efs_file_system" "checkpoint" {
  count = local.fsx ? 0 : 1

  encrypted        = true
  performance_mode = "generalPurpose"
  throughput_mode  = "elastic"
  tags             = merge(local.tags, { Name = "${local.name}-checkpoint" })
}

# EFS takes one mount target per zone, so one per zone of subnet_ids (the first subnet
# named in each zone).
resource "aws_efs_mount_target" "checkpoint" {
  for_each = local.fsx ? {} : local.subnet_per_zone

  file_system_id  = aws_efs_file_system.checkpoint[0].id
  subnet_id       = each.value[0]
  security_groups = [aws_security_group.checkpoint.id]
}
