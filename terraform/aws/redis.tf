# The optional Redis of the job: ElastiCache for Redis with TLS and AUTH, in the fleet's
# subnets, reachable only through the redis security group. The agents get its URL as
# rediss://<primary endpoint>:<port> and its password from Secrets Manager at boot.

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
  subnet_ids  = var.subnet_ids
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
  # but a preemption during the outage waits for it: a replica keeps the outage short.
  num_cache_clusters         = var.elasticache_num_nodes
  automatic_failover_enabled = var.elasticache_num_nodes > 1

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
  }
}
