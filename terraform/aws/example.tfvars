# A 2-8 node p5 job in one zone of us-east-1, its checkpoints on FSx for Lustre and copied
# to S3, its Redis on ElastiCache, its controller on a small VM.
#   AWS_REGION=us-east-1 terraform apply -var-file=example.tfvars   (in this folder)
# or the same values as arguments of a `module` block whose aws provider is in us-east-1.

run_id = "gpt-7b-20250701"

# An AWS Deep Learning Base GPU AMI (Ubuntu 24.04) of the region.
ami_id = "ami-0123456789abcdef0"

instance_types      = ["p5.48xlarge"]
efa_interface_count = 32
# One zone: the cluster placement group and the Lustre file system live in one.
subnet_ids = ["subnet-0123456789abcdef0"]

nodes_min      = 2
nodes_max      = 8
initial_size   = 4
gpus_per_node  = 8
nproc_per_node = 8

spottrain_version = "0.1.0"
git_repo          = "https://github.com/acme/gpt-train.git"
git_commit        = "3f2a9c1d4b5e6f708192a3b4c5d6e7f8091a2b3c"
train_command     = ["train.py", "--config", "configs/gpt-7b.yaml", "--name", "gpt 7b"]

checkpoint_filesystem    = "fsx-lustre"
fsx_deployment_type      = "SCRATCH_2"
fsx_storage_capacity_gib = 4800
checkpoint_copy_to       = "s3://acme-spottrain/checkpoints"

create_elasticache        = true
redis_password_secret_arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:spottrain/redis-AbCdEf"

create_controller = true

# Replica mode: replicas of nodes_per_replica nodes leave and join while the others keep
# training, each step's quorum kept in the run's Redis (replica_quorum = "lighthouse" runs
# torchft's lighthouse on the controller VM instead). The job spec must say the same
# (train.fault_tolerance: replica, train.replica).
# fault_tolerance   = "replica"
# nodes_per_replica = 1
# min_replicas      = 2
# replica_quorum    = "redis"
# With the Redis quorum (the spec's train.replica.wait_replicas, heartbeat_timeout_s,
# join_timeout_ms, relay_group_size; "auto" scales the heartbeat and join timeouts with the
# fleet and turns relays on from 1,000 replicas):
# replica_wait_replicas       = 0
# replica_heartbeat_timeout_s = "auto"
# replica_join_timeout_ms     = "auto"
# replica_relay_group_size    = "auto"
enable_ssm        = true
# Where engineers run `spottrain status` / `logs` from (the VPN), never 0.0.0.0/0.
controller_cidrs = ["10.100.0.0/16"]

tags = {
  team        = "ml-platform"
  cost-center = "research"
}
