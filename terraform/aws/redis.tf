# The optional Redis of the job: ElastiCache for Redis with TLS and AUTH, a primary and at
# least one replica in another zone (Multi-AZ, automatic failover), reachable only through
# the redis security group. The agents get its URL as rediss://<primary endpoint>:<port>
# and its password from Secrets Manager at boot.
#
# Replicas keep Redis up through a node's or a zone's loss, but a failover can lose the last
# writes (replication is asynchronous) and ElastiCache keeps no append-only file: the
# rendezvous state is not durable. What must never go backwards (the checkpoint fencing
# epoch) is kept beside the checkpoints, not here; see README.md.

data "aws_subnet" "redis" {
  for_each = var.create_elasticache ? toset(local.redis_subnet_ids) : toset([])
  id       = each.value
}

# The AUTH token is the secret the VMs read, so both sides agree by construction. Like any
# ElastiCache AUTH token it is stored in the Terraform state: keep the state encrypted and
# access-controlled.
data "aws_secretsmanager_secret_version" "redis_password" {
  count = var.create_elasticache ? 1 : 0

  secret_id = var.redis_password_secret_arn
}

resource "aws_elasticache_subnet_group" "redis" {
  count = var.create_elasticache ? 1 : 0

  name        = "${local.name}-redis"
  description = "spottrain run ${var.run_id}"
  subnet_ids  = local.redis_subnet_ids
  tags        = local.tags
}

resource "aws_elasticache_replication_group" "redis" {
  count = var.create_elasticache ? 1 : 0

  # 40 characters at most, so a hash of the run id; the tags name the run.
  replication_group_id = "spottrain-${substr(sha1(var.run_id), 0, 12)}"
  description          = "spottrain run ${var.run_id}: rendezvous and fleet state"

  engine               = "redis"
  engine_version       = "7.1"
  parameter_group_name = "default.redis7"
  node_type            = var.elasticache_node_type
  port                 = var.redis_port

  # Losing Redis for a while does not stop a training whose membership is not changing,
  # but a preemption during the outage waits for it: a replica in another zone, promoted
  # automatically, keeps the outage to a failover. One node is refused (variables.tf).
  num_cache_clusters         = var.elasticache_num_nodes
  automatic_failover_enabled = true
  multi_az_enabled           = true

  subnet_group_name  = aws_elasticache_subnet_group.redis[0].name
  security_group_ids = [aws_security_group.redis.id]

  transit_encryption_enabled = true
  at_rest_encryption_enabled = true
  auth_token                 = data.aws_secretsmanager_secret_version.redis_password[0].secret_string

  # A maintenance change should not restart the job's Redis in the middle of a run.
  apply_immediately = false

  tags = local.tags

  lifecycle {
    precondition {
      condition     = can(regex("^[!#-.0-?A-~]{16,128}$", data.aws_secretsmanager_secret_version.redis_password[0].secret_string))
      error_message = "The Redis password secret must be 16-128 printable characters without spaces, '\"', '/' or '@' (ElastiCache's AUTH token rules)."
    }
    precondition {
      condition     = length(distinct([for s in data.aws_subnet.redis : s.availability_zone])) >= 2
      error_message = "ElastiCache Multi-AZ needs subnets in at least two availability zones: give elasticache_subnet_ids (a single-zone fleet keeps its subnet_ids for the VMs)."
    }
    precondition {
      condition     = alltrue([for s in data.aws_subnet.redis : s.vpc_id == local.vpc_id])
      error_message = "elasticache_subnet_ids must be in the fleet's VPC (that of subnet_ids): the redis security group lives there."
    }
  }
}
