# Three groups, each open only to who needs it:
#   fleet:      the training VMs. All traffic among themselves (NCCL over EFA and TCP,
#               torchrun, the health check's collective, and in replica mode torchft's
#               managers, cross-replica process groups and live state transfers, whose
#               HTTP server takes a random port); nothing from anywhere else.
#   redis:      the job's Redis (the ElastiCache group, or attach it to your own Redis):
#               its port from the fleet and the controller only, never from the internet.
#   checkpoint: the shared file system's interfaces: the Lustre or NFS ports from the fleet.
# The optional controller VM has a group of its own: in replica mode the fleet may reach its
# lighthouse port, and nothing else reaches it.
# Rules are separate resources (not inline blocks), so adding one never rewrites the others.

resource "aws_security_group" "fleet" {
  name        = "${local.name}-fleet"
  description = "spottrain run ${var.run_id}: training VMs"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "${local.name}-fleet" })

  lifecycle {
    precondition {
      condition     = length(distinct([for id in var.subnet_ids : data.aws_subnet.fleet[id].vpc_id])) == 1
      error_message = "subnet_ids must all be in one VPC."
    }
  }
}

# EFA requires all traffic from the group itself (its SRD transport is not TCP or UDP).
resource "aws_vpc_security_group_ingress_rule" "fleet_from_fleet" {
  security_group_id            = aws_security_group.fleet.id
  description                  = "collectives and rendezvous among the fleet"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.fleet.id
  tags                         = local.tags
}

# pip, the code archive, Secrets Manager, S3, the Auto Scaling API, Redis: through the
# subnets' NAT gateway or VPC endpoints.
resource "aws_vpc_security_group_egress_rule" "fleet_out" {
  security_group_id = aws_security_group.fleet.id
  description       = "the VMs reach the AWS APIs, package indexes and Redis"
  ip_protocol       = "-1"
  cidr_ipv4         = "0.0.0.0/0"
  tags              = local.tags
}

# --- Redis -----------------------------------------------------------------------------------

resource "aws_security_group" "redis" {
  name        = "${local.name}-redis"
  description = "spottrain run ${var.run_id}: the job's Redis, from the fleet and the controller only"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "${local.name}-redis" })
}

resource "aws_vpc_security_group_ingress_rule" "redis_from_fleet" {
  security_group_id            = aws_security_group.redis.id
  description                  = "Redis from the training VMs"
  ip_protocol                  = "tcp"
  from_port                    = var.redis_port
  to_port                      = var.redis_port
  referenced_security_group_id = aws_security_group.fleet.id
  tags                         = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "redis_from_controller_vm" {
  count = var.create_controller ? 1 : 0

  security_group_id            = aws_security_group.redis.id
  description                  = "Redis from the spottrain controller VM"
  ip_protocol                  = "tcp"
  from_port                    = var.redis_port
  to_port                      = var.redis_port
  referenced_security_group_id = aws_security_group.controller[0].id
  tags                         = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "redis_from_controller_groups" {
  for_each = toset(var.controller_security_group_ids)

  security_group_id            = aws_security_group.redis.id
  description                  = "Redis from a spottrain controller"
  ip_protocol                  = "tcp"
  from_port                    = var.redis_port
  to_port                      = var.redis_port
  referenced_security_group_id = each.value
  tags                         = local.tags
}

# controller_cidrs is validated to hold no /0.
resource "aws_vpc_security_group_ingress_rule" "redis_from_controller_cidrs" {
  for_each = toset(var.controller_cidrs)

  security_group_id = aws_security_group.redis.id
  description       = "Redis from a spottrain controller's network"
  ip_protocol       = "tcp"
  from_port         = var.redis_port
  to_port           = var.redis_port
  cidr_ipv4         = each.value
  tags              = local.tags
}

# --- the checkpoint file system --------------------------------------------------------------

locals {
  # Lustre: 988 and 1018-1023, both ways between servers and clients (servers call the
  # clients back), and among the servers. NFS (EFS): 2049 from the clients.
  checkpoint_ports = local.fsx ? {
    "988"       = { from = 988, to = 988 }
    "1018-1023" = { from = 1018, to = 1023 }
    } : {
    "2049" = { from = 2049, to = 2049 }
  }
}

resource "aws_security_group" "checkpoint" {
  name        = "${local.name}-checkpoint"
  description = "spottrain run ${var.run_id}: the shared checkpoint file system"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "${local.name}-checkpoint" })
}

resource "aws_vpc_security_group_ingress_rule" "checkpoint_from_fleet" {
  for_each = local.checkpoint_ports

  security_group_id            = aws_security_group.checkpoint.id
  description                  = "checkpoint file system from the training VMs"
  ip_protocol                  = "tcp"
  from_port                    = each.value.from
  to_port                      = each.value.to
  referenced_security_group_id = aws_security_group.fleet.id
  tags                         = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "checkpoint_from_itself" {
  for_each = local.fsx ? local.checkpoint_ports : {}

  security_group_id            = aws_security_group.checkpoint.id
  description                  = "Lustre servers among themselves"
  ip_protocol                  = "tcp"
  from_port                    = each.value.from
  to_port                      = each.value.to
  referenced_security_group_id = aws_security_group.checkpoint.id
  tags                         = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "fleet_from_checkpoint" {
  for_each = local.fsx ? local.checkpoint_ports : {}

  security_group_id            = aws_security_group.fleet.id
  description                  = "Lustre servers calling their clients back"
  ip_protocol                  = "tcp"
  from_port                    = each.value.from
  to_port                      = each.value.to
  referenced_security_group_id = aws_security_group.checkpoint.id
  tags                         = local.tags
}

resource "aws_vpc_security_group_egress_rule" "checkpoint_to_fleet" {
  count = local.fsx ? 1 : 0

  security_group_id            = aws_security_group.checkpoint.id
  description                  = "Lustre servers to their clients"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.fleet.id
  tags                         = local.tags
}

resource "aws_vpc_security_group_egress_rule" "checkpoint_to_itself" {
  count = local.fsx ? 1 : 0

  security_group_id            = aws_security_group.checkpoint.id
  description                  = "Lustre servers among themselves"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.checkpoint.id
  tags                         = local.tags
}

# --- the controller VM -----------------------------------------------------------------------

# No inbound rule but the lighthouse's in replica mode: operators come in through Session
# Manager (enable_ssm), or add an SSH rule of their own for key_name.
resource "aws_security_group" "controller" {
  count = var.create_controller ? 1 : 0

  name        = "${local.name}-controller"
  description = "spottrain run ${var.run_id}: the controller VM"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "${local.name}-controller" })
}

resource "aws_vpc_security_group_egress_rule" "controller_out" {
  count = var.create_controller ? 1 : 0

  security_group_id = aws_security_group.controller[0].id
  description       = "the controller reaches the AWS APIs, package indexes and Redis"
  ip_protocol       = "-1"
  cidr_ipv4         = "0.0.0.0/0"
  tags              = local.tags
}

# The lighthouse quorum: every replica's manager asks the lighthouse for each step's quorum
# and heartbeats to it. From the fleet's group only; the lighthouse has no authentication.
# The Redis quorum needs no opening: the fleet reaches the run's Redis already.
resource "aws_vpc_security_group_ingress_rule" "controller_lighthouse_from_fleet" {
  count = local.lighthouse && var.create_controller ? 1 : 0

  security_group_id            = aws_security_group.controller[0].id
  description                  = "the torchft lighthouse from the training VMs"
  ip_protocol                  = "tcp"
  from_port                    = var.lighthouse_port
  to_port                      = var.lighthouse_port
  referenced_security_group_id = aws_security_group.fleet.id
  tags                         = local.tags
}
