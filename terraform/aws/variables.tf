# Inputs of the spottrain AWS fleet module. Every value that can be wrong is validated here,
# so a bad input fails `terraform plan` with a message naming the fix; checks that involve
# two inputs at once are lifecycle preconditions on the resources they affect.

# --- the run ---------------------------------------------------------------------------------

variable "run_id" {
  type        = string
  description = "The run's id: the `spottrain-job` tag the controller adopts the VMs by, the Redis key namespace and torchrun's --rdzv-id. Changing it replaces the whole fleet."
  nullable    = false

  validation {
    # The same shape the controller accepts for run ids; names built from it stay within
    # AWS's limits (ASG and launch template names, tag values).
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.run_id))
    error_message = "run_id must be 1-63 characters of lowercase letters, digits and '-', starting with a letter or digit."
  }
}

variable "tags" {
  type        = map(string)
  description = "Extra tags for every resource (and, through the launch template, every VM, volume and network interface)."
  default     = {}
  nullable    = false

  validation {
    # instance_metadata_tags is on, and EC2 then refuses to launch a VM whose tag keys hold
    # a '/' or a space; the spottrain- keys are this module's own.
    condition = alltrue([
      for k in keys(var.tags) :
      can(regex("^[A-Za-z0-9+=.,_:@-]{1,128}$", k)) && !startswith(lower(k), "aws:") && !startswith(k, "spottrain-")
    ])
    error_message = "tag keys may only use letters, digits and + = . , _ : @ - (no '/' or spaces: instance metadata tags are on), and may not start with 'aws:' or 'spottrain-'."
  }
}

# --- the fleet -------------------------------------------------------------------------------

variable "ami_id" {
  type        = string
  description = "The GPU AMI of the fleet (NVIDIA driver, python3 >= 3.11, the AWS CLI, an NFS client, and the Lustre client for fsx-lustre; an AWS Deep Learning Base GPU AMI fits)."
  nullable    = false

  validation {
    condition     = can(regex("^ami-([0-9a-f]{8}|[0-9a-f]{17})$", var.ami_id))
    error_message = "ami_id must be an AMI id such as ami-0123456789abcdef0."
  }
}

variable "instance_types" {
  type        = list(string)
  description = "The 8-GPU instance types of one family the group may launch (each an override of the mixed instances policy). Mixing GPU models in one job makes the slowest or smallest one set the pace."
  default     = ["p5.48xlarge"]
  nullable    = false

  validation {
    condition     = length(var.instance_types) > 0
    error_message = "instance_types must name at least one instance type."
  }
  validation {
    condition     = alltrue([for t in var.instance_types : can(regex("^[a-z][a-z0-9-]*\\.[0-9]*x?large$", t))])
    error_message = "instance_types must be EC2 instance type names such as p5.48xlarge."
  }
  validation {
    condition     = length(distinct(var.instance_types)) == length(var.instance_types)
    error_message = "instance_types must not repeat a type."
  }
}

variable "subnet_ids" {
  type        = list(string)
  description = "Private subnets (with a NAT gateway or VPC endpoints) the VMs, the checkpoint file system and the optional ElastiCache live in. One zone when cluster_placement_group is on."
  nullable    = false

  validation {
    condition     = length(var.subnet_ids) > 0 && alltrue([for s in var.subnet_ids : can(regex("^subnet-([0-9a-f]{8}|[0-9a-f]{17})$", s))])
    error_message = "subnet_ids must list at least one subnet id such as subnet-0123456789abcdef0."
  }
  validation {
    condition     = length(distinct(var.subnet_ids)) == length(var.subnet_ids)
    error_message = "subnet_ids must not repeat a subnet."
  }
}

variable "nodes_min" {
  type        = number
  description = "The fewest nodes training runs with (torchrun's --nnodes MIN); fewer, and the survivors wait for a backfill."
  default     = 1
  nullable    = false

  validation {
    condition     = var.nodes_min >= 1 && floor(var.nodes_min) == var.nodes_min
    error_message = "nodes_min must be a whole number of at least 1."
  }
}

variable "nodes_max" {
  type        = number
  description = "The most nodes of the job: the group's max_size and torchrun's --nnodes MAX."
  default     = 4
  nullable    = false

  # The job spec's own cap (spottrain.spec.fields.MAX_NODES): an Auto Scaling group has no
  # size limit of its own (the account's EC2 quotas are the limit), and the design's scale is
  # 12,500 VMs of 8 GPUs.
  validation {
    condition     = var.nodes_max >= 1 && var.nodes_max <= 100000 && floor(var.nodes_max) == var.nodes_max
    error_message = "nodes_max must be a whole number from 1 to 100000."
  }
}

variable "initial_size" {
  type        = number
  description = "The group's desired capacity when it is created (null: nodes_max). The spottrain controller owns the size afterwards; Terraform never resets it."
  default     = null

  validation {
    # A conditional, not ||: HCL evaluates both sides of || and null >= 0 is an error.
    condition     = var.initial_size == null ? true : (var.initial_size >= 0 && floor(var.initial_size) == var.initial_size)
    error_message = "initial_size must be null or a whole number of at least 0."
  }
}

variable "gpus_per_node" {
  type        = number
  description = "GPUs every VM must show at the agent's boot health check (SPOTTRAIN_EXPECT_GPUS); a VM with fewer stays out of the job."
  default     = 8
  nullable    = false

  validation {
    condition     = var.gpus_per_node >= 0 && var.gpus_per_node <= 16 && floor(var.gpus_per_node) == var.gpus_per_node
    error_message = "gpus_per_node must be a whole number from 0 to 16."
  }
}

variable "nproc_per_node" {
  type        = number
  description = "Training processes per VM (torchrun's --nproc-per-node), usually one per GPU."
  default     = 8
  nullable    = false

  validation {
    condition     = var.nproc_per_node >= 1 && var.nproc_per_node <= 64 && floor(var.nproc_per_node) == var.nproc_per_node
    error_message = "nproc_per_node must be a whole number from 1 to 64."
  }
}

variable "efa_enabled" {
  type        = bool
  description = "Give each VM EFA network interfaces (the p4d/p4de/p5 families and other EFA types). Turn off for types without EFA: EC2 refuses an EFA interface on them."
  default     = true
  nullable    = false
}

variable "efa_interface_count" {
  type        = number
  description = "EFA interfaces per VM, one per network card (1 works everywhere; p4d/p4de have 4 cards and p5 32, for their full bandwidth). At most the card count of the smallest type in instance_types."
  default     = 1
  nullable    = false

  validation {
    condition     = var.efa_interface_count >= 1 && var.efa_interface_count <= 32 && floor(var.efa_interface_count) == var.efa_interface_count
    error_message = "efa_interface_count must be a whole number from 1 to 32."
  }
}

variable "cluster_placement_group" {
  type        = bool
  description = "Launch the VMs into a cluster placement group (low-latency, high-bandwidth network for the collectives). Needs every subnet in one availability zone."
  default     = true
  nullable    = false
}

variable "capacity_rebalance" {
  type        = bool
  description = "Let the group replace a spot VM at elevated interruption risk before it is interrupted (the old VM then drains through the termination hook). Off by default: the controller backfills by itself."
  default     = false
  nullable    = false
}

variable "lifecycle_heartbeat_timeout_s" {
  type        = number
  description = "Seconds the termination lifecycle hook holds a VM the group terminates, so the agent can commit an emergency checkpoint and complete the lifecycle action itself."
  default     = 600
  nullable    = false

  validation {
    # 180 s: EC2's 2-minute spot notice window plus the agent's commit and leave margin
    # (the unit's TimeoutStopSec is 170). Shorter, and the group could terminate a VM whose
    # checkpoint still had time to commit. 7200 is the hook's API limit.
    condition     = var.lifecycle_heartbeat_timeout_s >= 180 && var.lifecycle_heartbeat_timeout_s <= 7200 && floor(var.lifecycle_heartbeat_timeout_s) == var.lifecycle_heartbeat_timeout_s
    error_message = "lifecycle_heartbeat_timeout_s must be a whole number of seconds from 180 (time for an emergency checkpoint) to 7200."
  }
}

variable "root_volume_size_gb" {
  type        = number
  description = "Root EBS volume size of each VM, GiB (gp3, encrypted). At least the AMI's snapshot size; deep learning AMIs need about 100 GiB plus the job's environment."
  default     = 200
  nullable    = false

  validation {
    condition     = var.root_volume_size_gb >= 30 && var.root_volume_size_gb <= 16384 && floor(var.root_volume_size_gb) == var.root_volume_size_gb
    error_message = "root_volume_size_gb must be a whole number from 30 to 16384."
  }
}

variable "key_name" {
  type        = string
  description = "An EC2 key pair for SSH to the VMs and the controller (empty: none; prefer enable_ssm)."
  default     = ""
  nullable    = false

  validation {
    condition     = length(var.key_name) <= 255
    error_message = "key_name must be at most 255 characters."
  }
}

variable "enable_ssm" {
  type        = bool
  description = "Attach AWS's AmazonSSMManagedInstanceCore policy to the VMs' and the controller's roles, for shell access through Session Manager without SSH or inbound rules."
  default     = false
  nullable    = false
}

# --- replica mode (issue 15) ------------------------------------------------------------------

variable "fault_tolerance" {
  type        = string
  description = "The job's fault tolerance, as its spec's train.fault_tolerance: elastic (every membership change restarts every worker from the last checkpoint) or replica (replicas of nodes_per_replica nodes leave and join while the others keep training, coordinated by the quorum that replica_quorum names)."
  default     = "elastic"
  nullable    = false

  validation {
    condition     = contains(["elastic", "replica"], var.fault_tolerance)
    error_message = "fault_tolerance must be \"elastic\" or \"replica\"."
  }
}

variable "integration" {
  type        = string
  description = "How the training script meets spottrain, as its spec's train.integration: sdk (spottrain's TrainSession), hf (a Hugging Face Trainer with spottrain's callback), accelerate (Accelerate with spottrain's helper), lightning (Lightning with spottrain's callback): each saves on the agent's checkpoint request; plain (a torchrun script that imports nothing of spottrain's: on a notice its workers get SIGTERM at once and have the window less the agent's 5 s notice margin to save). hf, accelerate and lightning: every VM installs spottrain's extra of that name (the framework at the versions spottrain's tests ran on), or finds it in env_lock, which must then be made from the job's spec (`spottrain lock`). Replica mode runs only sdk."
  default     = "sdk"
  nullable    = false

  validation {
    condition     = contains(["sdk", "hf", "accelerate", "lightning", "plain"], var.integration)
    error_message = "integration must be \"sdk\", \"hf\", \"accelerate\", \"lightning\" or \"plain\"."
  }
}

variable "nodes_per_replica" {
  type        = number
  description = "Replica mode: nodes in one replica (the spec's train.replica.nodes_per_replica); the replica shards the model inside and replicates across. Leave at 1 in elastic mode."
  default     = 1
  nullable    = false

  validation {
    condition     = var.nodes_per_replica >= 1 && var.nodes_per_replica <= 100000 && floor(var.nodes_per_replica) == var.nodes_per_replica
    error_message = "nodes_per_replica must be a whole number from 1 to 100000."
  }
}

variable "min_replicas" {
  type        = number
  description = "Replica mode: the fewest whole replicas a step may commit with (the spec's train.replica.min_replicas, the quorum's floor). Leave at 1 in elastic mode."
  default     = 1
  nullable    = false

  validation {
    condition     = var.min_replicas >= 1 && var.min_replicas <= 100000 && floor(var.min_replicas) == var.min_replicas
    error_message = "min_replicas must be a whole number from 1 to 100000."
  }
}

variable "replica_quorum" {
  type        = string
  description = "Replica mode: where each step's quorum forms (the spec's train.replica.quorum): redis (the default: in the run's Redis, which the fleet already reaches; nothing runs on the controller VM for it) or lighthouse (torchft's lighthouse on the controller VM, kept for comparison; needs create_controller and opens lighthouse_port to the fleet)."
  default     = "redis"
  nullable    = false

  validation {
    condition     = contains(["redis", "lighthouse"], var.replica_quorum)
    error_message = "replica_quorum must be \"redis\" or \"lighthouse\"."
  }
}

variable "replica_wait_replicas" {
  type        = number
  description = "Replica mode with replica_quorum = \"redis\": the Redis replicas that must hold each formed round before it is used (the spec's train.replica.wait_replicas; Redis WAIT; 0: none). Set it with a replicated Redis and min-replicas-to-write, so a failover never hands out a quorum id twice."
  default     = 0
  nullable    = false

  validation {
    condition     = var.replica_wait_replicas >= 0 && var.replica_wait_replicas <= 16 && floor(var.replica_wait_replicas) == var.replica_wait_replicas
    error_message = "replica_wait_replicas must be a whole number from 0 to 16 (Redis replicas to WAIT for)."
  }
}

variable "replica_heartbeat_timeout_s" {
  type        = string
  description = "Replica mode with replica_quorum = \"redis\": seconds without a heartbeat before the quorum drops a replica (the spec's train.replica.heartbeat_timeout_s; a silent loss costs the survivors about this). \"auto\" (the default) grows it with the fleet as the spec does, so heartbeats (replicas x 5 / timeout Redis calls a second, ~28 us each) take at most ~35 % of a Redis core: max(1, replicas / 2500) s rounded up to 0.5 s, with replicas = nodes_max / nodes_per_replica (1 s up to 2,500 replicas, 5 s at 12,500); or a number of seconds from 0.2 to 300."
  default     = "auto"
  nullable    = false

  validation {
    condition     = var.replica_heartbeat_timeout_s == "auto" || (can(regex("^[0-9]{1,3}([.][0-9]{1,3})?$", var.replica_heartbeat_timeout_s)) && try(tonumber(var.replica_heartbeat_timeout_s) >= 0.2 && tonumber(var.replica_heartbeat_timeout_s) <= 300, false))
    error_message = "replica_heartbeat_timeout_s must be \"auto\" or a number of seconds from 0.2 to 300."
  }
}

variable "replica_join_timeout_ms" {
  type        = string
  description = "Replica mode with replica_quorum = \"redis\": milliseconds a changed quorum waits for late replicas before it forms without them (the spec's train.replica.join_timeout_ms): \"auto\" (the default) scales it with the fleet as the spec does, max(250, 2 x replicas x 0.054) with replicas = nodes_max / nodes_per_replica, or a whole number from 50 to 60000."
  default     = "auto"
  nullable    = false

  validation {
    condition     = var.replica_join_timeout_ms == "auto" || (can(regex("^[0-9]{2,5}$", var.replica_join_timeout_ms)) && try(tonumber(var.replica_join_timeout_ms) >= 50 && tonumber(var.replica_join_timeout_ms) <= 60000, false))
    error_message = "replica_join_timeout_ms must be \"auto\" or a whole number of milliseconds from 50 to 60000."
  }
}

variable "replica_relay_group_size" {
  type        = string
  description = "Replica mode with replica_quorum = \"redis\": replicas per quorum relay (the spec's train.replica.relay_group_size): one VM of each group batches the group's per-step quorum requests into one Redis call and fans the answer out. \"auto\" (the default) is 0 (no relays) below 1,000 replicas (nodes_max / nodes_per_replica) and 100 from there, as the spec resolves it; \"0\" turns relays off; or a whole number from 2 to 1000. Relays listen on port 29513, open among the fleet's VMs like every port."
  default     = "auto"
  nullable    = false

  validation {
    condition     = var.replica_relay_group_size == "auto" || var.replica_relay_group_size == "0" || (can(regex("^[0-9]{1,4}$", var.replica_relay_group_size)) && try(tonumber(var.replica_relay_group_size) >= 2 && tonumber(var.replica_relay_group_size) <= 1000, false))
    error_message = "replica_relay_group_size must be \"auto\", \"0\" (no relays) or a whole number of replicas from 2 to 1000."
  }
}

variable "lighthouse_port" {
  type        = number
  description = "Replica mode with replica_quorum = \"lighthouse\": the TCP port of the torchft lighthouse on the controller VM; the fleet, and only the fleet, may reach it there."
  default     = 29510
  nullable    = false

  validation {
    condition     = var.lighthouse_port >= 1024 && var.lighthouse_port <= 65535 && floor(var.lighthouse_port) == var.lighthouse_port
    error_message = "lighthouse_port must be a TCP port from 1024 to 65535."
  }
}

variable "manager_port" {
  type        = number
  description = "Replica mode: the fixed TCP port of each replica's torchft manager on its first node (the agents' SPOTTRAIN_MANAGER_PORT); fleet members reach each other on every port already."
  default     = 29512
  nullable    = false

  validation {
    condition     = var.manager_port >= 1024 && var.manager_port <= 65535 && floor(var.manager_port) == var.manager_port
    error_message = "manager_port must be a TCP port from 1024 to 65535."
  }
}

# --- network ---------------------------------------------------------------------------------

variable "redis_port" {
  type        = number
  description = "The TCP port of the job's Redis (the ElastiCache port when create_elasticache)."
  default     = 6379
  nullable    = false

  validation {
    condition     = var.redis_port >= 1 && var.redis_port <= 65535 && floor(var.redis_port) == var.redis_port
    error_message = "redis_port must be a TCP port from 1 to 65535."
  }
}

variable "controller_cidrs" {
  type        = list(string)
  description = "IPv4 CIDRs the spottrain controller reaches Redis from (a workstation's VPN range, say), besides controller_security_group_ids and the optional controller VM."
  default     = []
  nullable    = false

  validation {
    condition     = alltrue([for c in var.controller_cidrs : can(cidrhost(c, 0)) && can(regex("^[0-9.]+/[0-9]+$", c))])
    error_message = "controller_cidrs must be IPv4 CIDR blocks such as 10.20.0.0/16."
  }
  validation {
    # Redis holds the rendezvous and the fleet's state: the open internet must never reach it.
    condition     = alltrue([for c in var.controller_cidrs : !endswith(c, "/0")])
    error_message = "controller_cidrs must not contain 0.0.0.0/0 (or any /0): Redis must not be reachable from the internet."
  }
}

variable "controller_security_group_ids" {
  type        = list(string)
  description = "Security groups of an existing spottrain controller that must reach Redis."
  default     = []
  nullable    = false

  validation {
    condition     = alltrue([for g in var.controller_security_group_ids : can(regex("^sg-([0-9a-f]{8}|[0-9a-f]{17})$", g))])
    error_message = "controller_security_group_ids must be security group ids such as sg-0123456789abcdef0."
  }
}

# --- checkpoints -----------------------------------------------------------------------------

variable "checkpoint_filesystem" {
  type        = string
  description = "The shared checkpoint volume mounted at /mnt/spottrain: fsx-lustre (FSx for Lustre, the fastest emergency checkpoints) or efs (EFS, elastic throughput, multi-zone)."
  default     = "fsx-lustre"
  nullable    = false

  validation {
    condition     = contains(["fsx-lustre", "efs"], var.checkpoint_filesystem)
    error_message = "checkpoint_filesystem must be \"fsx-lustre\" or \"efs\"."
  }
}

variable "fsx_deployment_type" {
  type        = string
  description = "FSx for Lustre deployment type: SCRATCH_2 (cheapest, no replication: fine for checkpoints also copied to checkpoint_copy_to) or PERSISTENT_2."
  default     = "SCRATCH_2"
  nullable    = false

  validation {
    condition     = contains(["SCRATCH_2", "PERSISTENT_2"], var.fsx_deployment_type)
    error_message = "fsx_deployment_type must be \"SCRATCH_2\" or \"PERSISTENT_2\"."
  }
}

variable "fsx_storage_capacity_gib" {
  type        = number
  description = "FSx for Lustre capacity, GiB (throughput grows with it: about 200 MB/s per TiB for SCRATCH_2)."
  default     = 1200
  nullable    = false

  validation {
    condition     = var.fsx_storage_capacity_gib == 1200 || (var.fsx_storage_capacity_gib >= 2400 && var.fsx_storage_capacity_gib % 2400 == 0)
    error_message = "fsx_storage_capacity_gib must be 1200 or a multiple of 2400 (FSx for Lustre SSD sizes)."
  }
}

variable "fsx_per_unit_storage_throughput" {
  type        = number
  description = "MB/s per TiB of a PERSISTENT_2 file system (ignored for SCRATCH_2)."
  default     = 250
  nullable    = false

  validation {
    condition     = contains([125, 250, 500, 1000], var.fsx_per_unit_storage_throughput)
    error_message = "fsx_per_unit_storage_throughput must be 125, 250, 500 or 1000."
  }
}

variable "checkpoint_copy_to" {
  type        = string
  description = "s3://bucket/prefix the agents copy committed checkpoints to (and restore from when the volume has nothing as new), so the job can move zones. Empty: no copies. The VMs may write only under <prefix>/<run_id>/."
  default     = ""
  nullable    = false

  validation {
    condition     = var.checkpoint_copy_to == "" || can(regex("^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9!_.*()=-]+)*/?$", var.checkpoint_copy_to))
    error_message = "checkpoint_copy_to must be empty or s3://bucket[/prefix] (prefix characters: letters, digits and ! _ . * ( ) = -)."
  }
}

# --- the job's code and command --------------------------------------------------------------

variable "spottrain_version" {
  type        = string
  description = "The spottrain release every VM installs (pip `spottrain[agent,aws]==<version>`), pinned so a backfilled node runs what the others run."
  default     = "0.1.0"
  nullable    = false

  validation {
    condition     = can(regex("^[0-9]+(\\.[0-9]+)*((a|b|rc)[0-9]+)?(\\.post[0-9]+)?(\\.dev[0-9]+)?$", var.spottrain_version))
    error_message = "spottrain_version must be an exact release such as 0.1.0 (no ranges: every node must run the same agent)."
  }
}

variable "code_archive_url" {
  type        = string
  description = "The job's code as an archive uploaded by spottrain (s3://bucket/prefix/code/<sha256>.tar.gz); set this and code_archive_sha256, or git_repo and git_commit."
  default     = ""
  nullable    = false

  validation {
    condition     = var.code_archive_url == "" || can(regex("^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9!_.*()=-]+)+$", var.code_archive_url))
    error_message = "code_archive_url must be empty or s3://bucket/key of the archive."
  }
}

variable "code_archive_sha256" {
  type        = string
  description = "The sha256 the archive must have (the boot refuses any other content)."
  default     = ""
  nullable    = false

  validation {
    condition     = var.code_archive_sha256 == "" || can(regex("^[0-9a-f]{64}$", var.code_archive_sha256))
    error_message = "code_archive_sha256 must be empty or 64 lowercase hex digits."
  }
}

variable "git_repo" {
  type        = string
  description = "The job's code as a git repository the VMs can fetch: https:// (a private one with git_token_secret_arn) or ssh:// with a deploy key baked into the AMI."
  default     = ""
  nullable    = false

  validation {
    condition     = var.git_repo == "" || can(regex("^(https://|ssh://|git@)[A-Za-z0-9@:/._~+-]+$", var.git_repo))
    error_message = "git_repo must be empty or an https://, ssh:// or git@ URL without quotes or spaces."
  }

  validation {
    condition     = !can(regex("^https?://[^/]*@", var.git_repo))
    error_message = "git_repo must not hold credentials (https://USER:TOKEN@...): it is rendered into the VMs' boot script, which anyone who can describe a VM reads. Use a repository the VMs can read without them, an ssh:// URL with a deploy key in the image, or a code archive."
  }
}

variable "git_commit" {
  type        = string
  description = "The full commit every VM checks out and verifies (a branch or tag would let backfilled nodes run other code)."
  default     = ""
  nullable    = false

  validation {
    condition     = var.git_commit == "" || can(regex("^[0-9a-f]{40}$", var.git_commit))
    error_message = "git_commit must be empty or a full 40-hex-digit commit id."
  }
}

variable "git_token_secret_arn" {
  type        = string
  description = "A private https:// git_repo's access token (the spec's code.git.token_secret): the full ARN, with its 6-character suffix, of a Secrets Manager secret whose SecretString is the token. Each VM reads it at boot into /etc/spottrain/git-token (mode 0600), which a root-only GIT_ASKPASS helper hands to git, and removes both once the commit is fetched; the token is never in user data or on a command line. The agents' role may read this secret. Empty: the repository needs no credentials."
  default     = ""
  nullable    = false

  validation {
    condition     = var.git_token_secret_arn == "" || can(regex("^arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:[A-Za-z0-9/_+=.@-]+-[A-Za-z0-9]{6}$", var.git_token_secret_arn))
    error_message = "git_token_secret_arn must be empty or the full ARN of a Secrets Manager secret, with the 6-character suffix AWS adds (arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME-AbCdEf): IAM grants read of exactly that ARN."
  }
}

variable "git_token_user" {
  type        = string
  description = "The user name git sends with git_token_secret_arn's token (the spec's code.git.token_user): GitHub ignores it, GitLab takes any, Bitbucket wants x-token-auth."
  default     = "x-access-token"
  nullable    = false

  validation {
    condition     = can(regex("^[A-Za-z0-9._-]{1,64}$", var.git_token_user))
    error_message = "git_token_user must be 1-64 letters, digits, '.', '_' or '-' (a git user name such as x-access-token)."
  }
}

variable "train_command" {
  type        = list(string)
  description = "The training script and its arguments as torchrun starts them in each worker, one list item per argument (run from /opt/job), e.g. [\"train.py\", \"--config\", \"gpt.yaml\"]."
  nullable    = false

  validation {
    condition     = length(var.train_command) > 0 && var.train_command[0] != ""
    error_message = "train_command must name at least the training script."
  }
  validation {
    # An environment file holds one value per line.
    condition     = alltrue([for a in var.train_command : !can(regex("[\r\n]", a))])
    error_message = "train_command arguments cannot hold line breaks."
  }
}

variable "secret_env_arns" {
  type        = map(string)
  description = "The job's secret environment variables (the spec's train.secret_env): ENV_NAME = the full ARN, with its 6-character suffix, of a Secrets Manager secret whose SecretString is the value (one line). Each VM reads them at boot into /etc/spottrain/agent.env (mode 0600), which the agent passes on to the workers; the values are never in user data or on a command line. The agents' role may read exactly these secrets."
  default     = {}
  nullable    = false

  validation {
    condition     = alltrue([for name in keys(var.secret_env_arns) : can(regex("^[A-Za-z_][A-Za-z0-9_]*$", name))])
    error_message = "secret_env_arns: each key must be an environment variable name (letters, digits and '_', not starting with a digit), such as HF_TOKEN."
  }
  validation {
    # The agent's own settings: a job variable of that name would override them.
    condition     = alltrue([for name in keys(var.secret_env_arns) : !startswith(name, "SPOTTRAIN_")])
    error_message = "secret_env_arns: SPOTTRAIN_* variables are set by spottrain itself; give the job's variables their own names (HF_TOKEN, WANDB_API_KEY, ...)."
  }
  validation {
    condition     = alltrue([for arn in values(var.secret_env_arns) : can(regex("^arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:[A-Za-z0-9/_+=.@-]+-[A-Za-z0-9]{6}$", arn))])
    error_message = "secret_env_arns: each value must be the full ARN of a Secrets Manager secret, with the 6-character suffix AWS adds (arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME-AbCdEf): IAM grants read of exactly those ARNs."
  }
}

# --- Redis -----------------------------------------------------------------------------------

variable "redis_url" {
  type        = string
  description = "The job's existing Redis as the VMs reach it, redis://HOST:PORT or rediss://HOST:PORT (TLS). Never with a password in it: give redis_password_secret_arn. Leave empty with create_elasticache."
  default     = ""
  nullable    = false

  validation {
    # No user info: the URL travels in user data, which anyone allowed to describe the
    # launch template can read.
    condition     = var.redis_url == "" || can(regex("^rediss?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[0-9]{1,2})?$", var.redis_url))
    error_message = "redis_url must be empty or redis[s]://HOST[:PORT][/DB] without credentials (put the password in Secrets Manager: redis_password_secret_arn)."
  }
}

variable "redis_password_secret_arn" {
  type        = string
  description = "A Secrets Manager secret (its full ARN, with the 6-character suffix) whose SecretString is the bare Redis password; each VM fetches it at boot into /etc/spottrain/redis-password (mode 0600). Empty: Redis without a password (only on a private network). Required with create_elasticache."
  default     = ""
  nullable    = false

  validation {
    condition     = var.redis_password_secret_arn == "" || can(regex("^arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:[A-Za-z0-9/_+=.@-]+$", var.redis_password_secret_arn))
    error_message = "redis_password_secret_arn must be empty or a Secrets Manager secret ARN."
  }
}

variable "kms_key_arns" {
  type        = list(string)
  description = "Customer-managed KMS keys encrypting the secrets (Redis password, git token, secret_env_arns) or the checkpoint copy bucket; the roles may use them only through Secrets Manager and S3."
  default     = []
  nullable    = false

  validation {
    condition     = alltrue([for k in var.kms_key_arns : can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/[0-9a-f-]+$", k))])
    error_message = "kms_key_arns must be KMS key ARNs (arn:aws:kms:REGION:ACCOUNT:key/ID)."
  }
}

variable "create_elasticache" {
  type        = bool
  description = "Create an ElastiCache for Redis replication group (TLS, encrypted at rest, AUTH from redis_password_secret_arn) in the fleet's subnets, instead of using redis_url."
  default     = false
  nullable    = false
}

variable "elasticache_node_type" {
  type        = string
  description = "Node type of the ElastiCache replication group. The job's Redis traffic is small (rendezvous, heartbeats, events)."
  default     = "cache.t4g.medium"
  nullable    = false

  validation {
    condition     = can(regex("^cache\\.[a-z0-9]+\\.[a-z0-9]+$", var.elasticache_node_type))
    error_message = "elasticache_node_type must be an ElastiCache node type such as cache.t4g.medium."
  }
}

variable "elasticache_num_nodes" {
  type        = number
  description = "ElastiCache nodes: a primary and 1 to 5 replicas, spread over zones (Multi-AZ, automatic failover)."
  default     = 2
  nullable    = false

  validation {
    condition     = var.elasticache_num_nodes >= 2 && var.elasticache_num_nodes <= 6 && floor(var.elasticache_num_nodes) == var.elasticache_num_nodes
    error_message = "elasticache_num_nodes must be a whole number from 2 to 6: one node has no replica, and losing it stops every membership change of the job."
  }
}

variable "elasticache_subnet_ids" {
  type        = list(string)
  description = "Subnets of the ElastiCache replication group, in at least two availability zones (Multi-AZ) of the fleet's VPC; empty: subnet_ids."
  default     = []
  nullable    = false

  validation {
    condition     = alltrue([for id in var.elasticache_subnet_ids : can(regex("^subnet-[0-9a-f]+$", id))])
    error_message = "elasticache_subnet_ids must be subnet ids (subnet-...)."
  }
}

# --- the optional controller VM --------------------------------------------------------------

variable "create_controller" {
  type        = bool
  description = "Create a small on-demand VM with spottrain installed that runs the job's controller."
  default     = false
  nullable    = false
}

variable "controller_instance_type" {
  type        = string
  description = "Instance type of the controller VM (x86_64 when controller_ami_id is empty)."
  default     = "t3.small"
  nullable    = false

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", var.controller_instance_type))
    error_message = "controller_instance_type must be an EC2 instance type such as t3.small."
  }
}

variable "controller_ami_id" {
  type        = string
  description = "AMI of the controller VM (empty: the newest Amazon Linux 2023 for x86_64, read once; later releases do not replace the VM)."
  default     = ""
  nullable    = false

  validation {
    condition     = var.controller_ami_id == "" || can(regex("^ami-([0-9a-f]{8}|[0-9a-f]{17})$", var.controller_ami_id))
    error_message = "controller_ami_id must be empty or an AMI id such as ami-0123456789abcdef0."
  }
}

variable "controller_job_spec_yaml" {
  type        = string
  description = "A spottrain job spec (YAML). When set, the controller VM starts `spottrain up /etc/spottrain/job.yaml --detach` once at first boot, with the spec's fleet: section set to this module's spottrain_fleet output. Empty: an operator starts the controller."
  default     = ""
  nullable    = false

  validation {
    condition     = var.controller_job_spec_yaml == "" || can(keys(yamldecode(var.controller_job_spec_yaml)))
    error_message = "controller_job_spec_yaml must be empty or a YAML mapping (a spottrain job spec)."
  }
}

variable "env_lock" {
  type        = string
  description = "Optional hashed lock of the agents' environment (the text `spottrain lock JOB.yaml --cloud CLOUD` writes): every VM builds its venv from it with pip --require-hashes --no-deps, rebuilds it when the lock changes, and verifies it at every boot, so a backfilled VM runs exactly the others' packages. Empty: the VMs install spottrain_version's requirement from the index (versions may drift between VMs booted at different times)."
  default     = ""
  nullable    = false

  validation {
    # One `name==version --hash=sha256:<64 hex>` (or `name @ URL --hash=...`) per line,
    # comments and blank lines aside: nothing else may reach the boot script's heredoc.
    condition = alltrue([
      for line in split("\n", var.env_lock) :
      line == "" || can(regex("^#[^']*$", line)) || can(regex("^[A-Za-z0-9][A-Za-z0-9._-]*(==[A-Za-z0-9.!+_-]+| @ https://[^ ']+)( --hash=sha256:[0-9a-f]{64})+$", line))
    ])
    error_message = "env_lock: give the text of `spottrain lock` (one `name==version --hash=sha256:...` per line)."
  }
  validation {
    # AWS user data holds at most 16 KB: the boot script with its lock is gzipped, and a lock
    # this long still fits.
    condition     = length(var.env_lock) <= 16000
    error_message = "env_lock: longer than 16,000 characters; the boot script must stay within AWS's 16 KB of (gzipped) user data."
  }
}
