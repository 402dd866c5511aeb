# ---------------------------------------------------------------------------------------------
# Where the fleet lives
# ---------------------------------------------------------------------------------------------

variable "project" {
  type        = string
  description = "GCP project id that holds every resource of the fleet."

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project))
    error_message = "project: give a project id (6-30 lowercase letters, digits and dashes, starting with a letter), not its name or number."
  }
}

variable "zone" {
  type        = string
  description = "Zone of the whole fleet, its Filestore and the controller VM (e.g. us-central1-a). One zone on purpose: synchronous training needs the fast, uniform network of one zone, and the Filestore tiers offered here are zonal."

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]+-[a-z]$", var.zone))
    error_message = "zone: give a zone such as us-central1-a (region plus a letter), not a region."
  }
}

variable "run_id" {
  type        = string
  description = "The run id the fleet trains under: the `spottrain-job` label the controller adopts VMs by, every agent's SPOTTRAIN_RUN_ID (torchrun's rendezvous id), and part of every resource name (spottrain-<run_id>...)."

  # The label rule (GCP label values: lowercase letters, digits, '-' and '_'; '_' is left out
  # because the id also goes into resource names, which refuse it).
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.run_id))
    error_message = "run_id: use lowercase letters, digits and dashes, starting with a letter or digit (it becomes the spottrain-job label)."
  }

  # The names built from it: "spottrain-<run_id>-controller" must fit GCP's 63 characters and
  # the template's name_prefix its 54, and a name cannot end with a dash.
  validation {
    condition     = length(var.run_id) <= 40 && !endswith(var.run_id, "-")
    error_message = "run_id: at most 40 characters, not ending with a dash (resource names spottrain-<run_id>-... must stay within GCP's 63)."
  }
}

variable "network" {
  type        = string
  description = "VPC network name of the fleet, its Filestore and firewall rules. A dedicated network is safer than `default`, whose default-allow-internal rule opens every port to the whole 10.128.0.0/9 range."
  default     = "default"

  validation {
    condition     = can(regex("^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$", var.network))
    error_message = "network: give the network's name (lowercase letters, digits, dashes), not a URL."
  }
}

variable "subnetwork" {
  type        = string
  description = "Subnetwork name (in the zone's region) of the fleet and controller VMs. Its primary range is the only one the Filestore share is exported to. VMs have no external IP unless external_ip is set, so the subnetwork needs Cloud NAT (for pip) and Private Google Access (for Cloud Storage, Secret Manager, Logging)."
  default     = "default"

  validation {
    condition     = can(regex("^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$", var.subnetwork))
    error_message = "subnetwork: give the subnetwork's name (lowercase letters, digits, dashes), not a URL."
  }
}

variable "external_ip" {
  type        = bool
  description = "Give each VM an ephemeral external IP, for networks without Cloud NAT. No firewall rule of this module admits traffic from the internet either way."
  default     = false
}

variable "labels" {
  type        = map(string)
  description = "Extra labels on every resource (cost centre, team). The module's own labels (spottrain-job, spottrain-managed-by) win over these."
  default     = {}

  validation {
    condition = alltrue([
      for k, v in var.labels :
      can(regex("^[a-z][a-z0-9_-]{0,62}$", k)) && can(regex("^[a-z0-9_-]{0,63}$", v))
    ])
    error_message = "labels: keys start with a lowercase letter; keys and values use only lowercase letters, digits, '-' and '_' (at most 63)."
  }
}

# ---------------------------------------------------------------------------------------------
# The spot VMs
# ---------------------------------------------------------------------------------------------

variable "machine_type" {
  type        = string
  description = "GPU machine type of every node. A3 and A2 types come with their GPUs attached (no guest_accelerator block): a3-highgpu-8g, a3-megagpu-8g (8 H100), a3-ultragpu-8g (8 H200), a2-highgpu-8g (8 A100 40GB), a2-ultragpu-8g (8 A100 80GB), a2-megagpu-16g (16 A100 40GB)."
  default     = "a3-highgpu-8g"

  validation {
    condition = contains([
      "a3-highgpu-8g", "a3-megagpu-8g", "a3-ultragpu-8g",
      "a2-highgpu-8g", "a2-ultragpu-8g", "a2-megagpu-16g",
    ], var.machine_type)
    error_message = "machine_type: use one of a3-highgpu-8g, a3-megagpu-8g, a3-ultragpu-8g, a2-highgpu-8g, a2-ultragpu-8g, a2-megagpu-16g."
  }
}

variable "image" {
  type        = string
  description = "Boot image of the nodes (projects/P/global/images/family/F or .../images/NAME): Debian or Ubuntu with the NVIDIA driver, python3 >= 3.11 and gcloud, e.g. an Ubuntu 24.04 accelerator image. The startup script installs nfs-common, python3-venv and git with apt-get when they are missing."

  validation {
    condition     = can(regex("^(projects/[a-z][-a-z0-9]*/global/images/(family/)?[a-z][-a-z0-9]*|[a-z][-a-z0-9]*/[a-z][-a-z0-9]*)$", var.image))
    error_message = "image: give projects/PROJECT/global/images/family/FAMILY, projects/PROJECT/global/images/NAME, or PROJECT/FAMILY."
  }
}

variable "boot_disk_gb" {
  type        = number
  description = "Boot disk size of each node, GB: the NVIDIA stack, the venv with torch and the job's code live there."
  default     = 200

  validation {
    condition     = var.boot_disk_gb == floor(var.boot_disk_gb) && var.boot_disk_gb >= 50 && var.boot_disk_gb <= 10000
    error_message = "boot_disk_gb: a whole number of GB between 50 and 10000."
  }
}

variable "boot_disk_type" {
  type        = string
  description = "Boot disk type. Default (null): hyperdisk-balanced for a3-ultragpu-8g, which supports only Hyperdisk, pd-balanced for the others."
  default     = null

  validation {
    condition     = var.boot_disk_type == null ? true : contains(["pd-balanced", "pd-ssd", "hyperdisk-balanced"], var.boot_disk_type)
    error_message = "boot_disk_type: use pd-balanced, pd-ssd or hyperdisk-balanced (or leave it null)."
  }
}

variable "termination_action" {
  type        = string
  description = "What GCP does to a preempted node: STOP (default: the stopped VM keeps its labels, so the controller, even one restarted meanwhile, sees the preemption) or DELETE. The MIG recreates the VM either way; see fleet.tf."
  default     = "STOP"

  validation {
    condition     = contains(["STOP", "DELETE"], var.termination_action)
    error_message = "termination_action: use STOP or DELETE."
  }
}

variable "secure_boot" {
  type        = bool
  description = "Shielded VM Secure Boot on the nodes. Off by default: it refuses unsigned kernel modules, and many GPU images' NVIDIA drivers are not signed with a key the firmware trusts. vTPM and integrity monitoring are always on."
  default     = false
}

variable "initial_size" {
  type        = number
  description = "Nodes the instance group starts with. Terraform sets it at creation only: afterwards the spottrain controller owns the group's size."

  validation {
    condition     = var.initial_size == floor(var.initial_size) && var.initial_size >= 0 && var.initial_size <= 256
    error_message = "initial_size: a whole number from 0 to 256 (the largest fleet spottrain supports per job)."
  }
}

variable "nnodes_min" {
  type        = number
  description = "Fewest nodes training runs with (the MIN of torchrun's --nnodes MIN:MAX)."

  validation {
    condition     = var.nnodes_min == floor(var.nnodes_min) && var.nnodes_min >= 1 && var.nnodes_min <= 256
    error_message = "nnodes_min: a whole number from 1 to 256."
  }
}

variable "nnodes_max" {
  type        = number
  description = "Most nodes training runs with (the MAX of torchrun's --nnodes MIN:MAX); at least nnodes_min."

  validation {
    condition     = var.nnodes_max == floor(var.nnodes_max) && var.nnodes_max >= 1 && var.nnodes_max <= 256
    error_message = "nnodes_max: a whole number from 1 to 256."
  }
}

variable "nproc_per_node" {
  type        = number
  description = "Workers per node (torchrun's --nproc-per-node). Default (null): one per GPU of machine_type."
  default     = null

  validation {
    condition     = var.nproc_per_node == null ? true : (var.nproc_per_node == floor(var.nproc_per_node) && var.nproc_per_node >= 1 && var.nproc_per_node <= 64)
    error_message = "nproc_per_node: a whole number from 1 to 64, or null for one per GPU."
  }
}

# ---------------------------------------------------------------------------------------------
# Replica mode (issue 15)
# ---------------------------------------------------------------------------------------------

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
    condition     = var.nodes_per_replica >= 1 && var.nodes_per_replica <= 1000 && floor(var.nodes_per_replica) == var.nodes_per_replica
    error_message = "nodes_per_replica must be a whole number from 1 to 1000."
  }
}

variable "min_replicas" {
  type        = number
  description = "Replica mode: the fewest whole replicas a step may commit with (the spec's train.replica.min_replicas, the quorum's floor). Leave at 1 in elastic mode."
  default     = 1
  nullable    = false

  validation {
    condition     = var.min_replicas >= 1 && var.min_replicas <= 1000 && floor(var.min_replicas) == var.min_replicas
    error_message = "min_replicas must be a whole number from 1 to 1000."
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
  description = "Replica mode with replica_quorum = \"redis\": seconds without a heartbeat before the quorum drops a replica (the spec's train.replica.heartbeat_timeout_s; a silent loss costs the survivors about this). \"auto\" (the default) grows it with the fleet as the spec does, so heartbeats (replicas x 5 / timeout Redis calls a second, ~28 us each) take at most ~35 % of a Redis core: max(1, replicas / 2500) s rounded up to 0.5 s, with replicas = nnodes_max / nodes_per_replica (1 s up to 2,500 replicas, 5 s at 12,500); or a number of seconds from 0.2 to 300."
  default     = "auto"
  nullable    = false

  validation {
    condition     = var.replica_heartbeat_timeout_s == "auto" || (can(regex("^[0-9]{1,3}([.][0-9]{1,3})?$", var.replica_heartbeat_timeout_s)) && try(tonumber(var.replica_heartbeat_timeout_s) >= 0.2 && tonumber(var.replica_heartbeat_timeout_s) <= 300, false))
    error_message = "replica_heartbeat_timeout_s must be \"auto\" or a number of seconds from 0.2 to 300."
  }
}

variable "replica_join_timeout_ms" {
  type        = string
  description = "Replica mode with replica_quorum = \"redis\": milliseconds a changed quorum waits for late replicas before it forms without them (the spec's train.replica.join_timeout_ms): \"auto\" (the default) scales it with the fleet as the spec does, max(250, 2 x replicas x 0.054) with replicas = nnodes_max / nodes_per_replica, or a whole number from 50 to 60000."
  default     = "auto"
  nullable    = false

  validation {
    condition     = var.replica_join_timeout_ms == "auto" || (can(regex("^[0-9]{2,5}$", var.replica_join_timeout_ms)) && try(tonumber(var.replica_join_timeout_ms) >= 50 && tonumber(var.replica_join_timeout_ms) <= 60000, false))
    error_message = "replica_join_timeout_ms must be \"auto\" or a whole number of milliseconds from 50 to 60000."
  }
}

variable "replica_relay_group_size" {
  type        = string
  description = "Replica mode with replica_quorum = \"redis\": replicas per quorum relay (the spec's train.replica.relay_group_size): one VM of each group batches the group's per-step quorum requests into one Redis call and fans the answer out. \"auto\" (the default) is 0 (no relays) below 1,000 replicas (nnodes_max / nodes_per_replica) and 100 from there, as the spec resolves it; \"0\" turns relays off; or a whole number from 2 to 1000. Relays listen on port 29513, open among the fleet's VMs like every port."
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

# ---------------------------------------------------------------------------------------------
# What every node runs
# ---------------------------------------------------------------------------------------------

variable "spottrain_version" {
  type        = string
  description = "The spottrain release every VM installs (pip's spottrain[agent,gcp]==VERSION). Use the controller's own version: agents and controller share the Redis schema."

  validation {
    condition     = can(regex("^[0-9]+(\\.[0-9]+)*((a|b|rc)[0-9]+)?(\\.post[0-9]+)?(\\.dev[0-9]+)?$", var.spottrain_version))
    error_message = "spottrain_version: give an exact release such as 0.1.0 (a PEP 440 version, no range and no local part)."
  }
}

variable "train_command" {
  type        = list(string)
  description = "The training script and its arguments, as the job spec's train.command: one list item per argument, no shell quoting needed (the module quotes them)."

  validation {
    condition     = length(var.train_command) > 0 && alltrue([for a in var.train_command : length(a) > 0 && !can(regex("[\\r\\n]", a))])
    error_message = "train_command: at least the script, and no empty argument or argument with a newline (an environment file cannot carry one)."
  }
}

variable "secret_env" {
  type        = map(string)
  description = "The job's secret environment variables (the spec's train.secret_env): ENV_NAME = the id of a Secret Manager secret in this project holding the value (one line). Each node reads them at every boot into /etc/spottrain/agent.env (mode 0600), which the agent passes on to the workers; the values are never in metadata or on a command line. The nodes get secretAccessor on exactly these secrets."
  default     = {}
  nullable    = false

  validation {
    condition     = alltrue([for name in keys(var.secret_env) : can(regex("^[A-Za-z_][A-Za-z0-9_]*$", name))])
    error_message = "secret_env: each key must be an environment variable name (letters, digits and '_', not starting with a digit), such as HF_TOKEN."
  }
  validation {
    # The agent's own settings: a job variable of that name would override them.
    condition     = alltrue([for name in keys(var.secret_env) : !startswith(name, "SPOTTRAIN_")])
    error_message = "secret_env: SPOTTRAIN_* variables are set by spottrain itself; give the job's variables their own names (HF_TOKEN, WANDB_API_KEY, ...)."
  }
  validation {
    condition     = alltrue([for secret in values(var.secret_env) : can(regex("^[A-Za-z0-9_-]{1,255}$", secret))])
    error_message = "secret_env: each value must be a Secret Manager secret id in this project (letters, digits, '_' and '-'), not a path or a version."
  }
}

variable "code_archive_url" {
  type        = string
  description = "The job's code as a spottrain code archive (gs://BUCKET/.../code/<sha256>.tar.gz, as `spottrain up` uploads it). Give this and code_archive_sha256, or git_repo and git_commit."
  default     = ""

  validation {
    condition     = var.code_archive_url == "" || can(regex("^(gs|s3|https)://[A-Za-z0-9._~:/?#@!&+,;=%-]+$", var.code_archive_url))
    error_message = "code_archive_url: give a gs://, s3:// or https:// URL without spaces, quotes or '$'."
  }
}

variable "code_archive_sha256" {
  type        = string
  description = "sha256 of the code archive (64 hex digits); the VM refuses an archive with another hash."
  default     = ""

  validation {
    condition     = var.code_archive_sha256 == "" || can(regex("^[0-9a-f]{64}$", var.code_archive_sha256))
    error_message = "code_archive_sha256: 64 lowercase hex digits."
  }
}

variable "git_repo" {
  type        = string
  description = "The job's code as a git repository the VMs can clone (https://, a private one with git_token_secret, or ssh), checked out at git_commit."
  default     = ""

  validation {
    condition     = var.git_repo == "" || can(regex("^(https://|ssh://|git@)[A-Za-z0-9._~:/@+%-]+$", var.git_repo))
    error_message = "git_repo: give an https://, ssh:// or git@host:path URL without spaces, quotes or '$'."
  }

  validation {
    condition     = !can(regex("^https?://[^/]*@", var.git_repo))
    error_message = "git_repo must not hold credentials (https://USER:TOKEN@...): it is rendered into the VMs' boot script, which anyone who can describe a VM reads. Use a repository the VMs can read without them, an ssh:// URL with a deploy key in the image, or a code archive."
  }
}

variable "git_commit" {
  type        = string
  description = "The full commit the nodes check out (40 hex digits): a backfilled node must run exactly what the others run, so no branch or tag."
  default     = ""

  validation {
    condition     = var.git_commit == "" || can(regex("^[0-9a-f]{40}$", var.git_commit))
    error_message = "git_commit: the full 40-hex-digit commit id, not a branch, tag or short id."
  }
}

variable "git_token_secret" {
  type        = string
  description = "A private https:// git_repo's access token (the spec's code.git.token_secret): the id of a Secret Manager secret in this project holding it. Each node reads it at boot into /etc/spottrain/git-token (mode 0600), which a root-only GIT_ASKPASS helper hands to git, and removes both once the commit is fetched; the token is never in metadata or on a command line. The nodes get secretAccessor on this secret. Empty: the repository needs no credentials."
  default     = ""
  nullable    = false

  validation {
    condition     = var.git_token_secret == "" || can(regex("^[A-Za-z0-9_-]{1,255}$", var.git_token_secret))
    error_message = "git_token_secret: a Secret Manager secret id in this project (letters, digits, '_' and '-'), not a path or a version."
  }
}

variable "git_token_user" {
  type        = string
  description = "The user name git sends with git_token_secret's token (the spec's code.git.token_user): GitHub ignores it, GitLab takes any, Bitbucket wants x-token-auth."
  default     = "x-access-token"
  nullable    = false

  validation {
    condition     = can(regex("^[A-Za-z0-9._-]{1,64}$", var.git_token_user))
    error_message = "git_token_user: 1-64 letters, digits, '.', '_' or '-' (a git user name such as x-access-token)."
  }
}

variable "git_subdir" {
  type        = string
  description = "Directory inside the repository whose requirements.txt is installed (the job's own dependencies); empty for the top."
  default     = ""

  validation {
    condition     = var.git_subdir == "" || can(regex("^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$", var.git_subdir)) && !can(regex("(^|/)\\.\\.(/|$)", var.git_subdir))
    error_message = "git_subdir: a relative path of letters, digits, '.', '_' and '-', without '..'."
  }
}

variable "checkpoint_copy_to" {
  type        = string
  description = "Cloud Storage prefix (gs://BUCKET/PREFIX) every node copies the checkpoints it commits to, so the job can move zones; empty for none. The nodes get storage.objectAdmin under <checkpoint_copy_to>/<run_id>/ only (an IAM condition: the bucket needs uniform bucket-level access)."
  default     = ""

  validation {
    condition     = var.checkpoint_copy_to == "" || can(regex("^gs://[a-z0-9][a-z0-9._-]{1,221}[a-z0-9](/[A-Za-z0-9._/-]*)?$", var.checkpoint_copy_to))
    error_message = "checkpoint_copy_to: give gs://BUCKET or gs://BUCKET/PREFIX (letters, digits, '.', '_', '-', '/'), or leave it empty."
  }
}

# ---------------------------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------------------------

variable "redis_url" {
  type        = string
  description = "The job's Redis as the VMs reach it: redis://HOST:PORT or rediss://HOST:PORT (TLS), with an explicit port. Never a password in it: use redis_password_secret."

  validation {
    condition     = can(regex("^rediss?://[A-Za-z0-9.-]+:[0-9]{1,5}(/[0-9]{1,2})?$", var.redis_url))
    error_message = "redis_url: give redis://HOST:PORT or rediss://HOST:PORT (no credentials: the password comes from redis_password_secret)."
  }
}

variable "redis_password_secret" {
  type        = string
  description = "Secret Manager secret (its id, in this project) holding the Redis password; empty when Redis has none. The nodes get secretAccessor on this secret only and read it at every boot into a root-only file."
  default     = ""

  validation {
    condition     = var.redis_password_secret == "" || can(regex("^[A-Za-z0-9_-]{1,255}$", var.redis_password_secret))
    error_message = "redis_password_secret: a secret id (letters, digits, '_' and '-'), not a path or a version."
  }
}

variable "redis_port" {
  type        = number
  description = "TCP port of the job's Redis (the port in redis_url), opened on the Redis hosts to the fleet, the controller VM and controller_cidrs only."
  default     = 6379

  validation {
    condition     = var.redis_port == floor(var.redis_port) && var.redis_port >= 1 && var.redis_port <= 65535
    error_message = "redis_port: a TCP port, 1 to 65535."
  }
}

variable "redis_target_tags" {
  type        = list(string)
  description = "Network tags of the VMs that serve the job's Redis: the Redis firewall rule admits the fleet and the controllers to them. (Memorystore is not governed by VPC firewall rules; its authorized network does that.)"
  default     = ["spottrain-redis"]

  validation {
    condition     = length(var.redis_target_tags) > 0 && alltrue([for t in var.redis_target_tags : can(regex("^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$", t))])
    error_message = "redis_target_tags: at least one network tag (lowercase letters, digits and dashes, starting with a letter)."
  }
}

variable "controller_cidrs" {
  type        = list(string)
  description = "Address ranges of spottrain controllers outside this module (a workstation's VPN range, a CI runner) that may reach Redis. Never the whole internet."
  default     = []

  validation {
    condition     = alltrue([for c in var.controller_cidrs : can(cidrhost(c, 0))])
    error_message = "controller_cidrs: every item must be a CIDR range such as 10.20.0.0/24."
  }

  # Redis is the job's control plane (rendezvous, drain requests): it must never be open to
  # the internet, whatever its password.
  validation {
    condition     = alltrue([for c in var.controller_cidrs : !contains(["0.0.0.0/0", "::/0"], c) && try(tonumber(split("/", c)[1]) >= 8, false)])
    error_message = "controller_cidrs: 0.0.0.0/0, ::/0 and any range wider than /8 would expose Redis to the internet; list your controllers' ranges."
  }
}

# ---------------------------------------------------------------------------------------------
# Checkpoint volume (Filestore)
# ---------------------------------------------------------------------------------------------

variable "filestore_tier" {
  type        = string
  description = "Filestore tier of the checkpoint volume: ZONAL (default; throughput grows with capacity), BASIC_SSD, or HIGH_SCALE_SSD. GCP's 30-second preemption notice leaves about 20 s to write an emergency checkpoint, which rules out BASIC_HDD."
  default     = "ZONAL"

  validation {
    condition     = contains(["BASIC_SSD", "ZONAL", "HIGH_SCALE_SSD"], var.filestore_tier)
    error_message = "filestore_tier: use BASIC_SSD, ZONAL or HIGH_SCALE_SSD."
  }
}

variable "filestore_capacity_gb" {
  type        = number
  description = "Capacity of the checkpoint share, GiB. Tier minimums: ZONAL 1024, BASIC_SSD 2560, HIGH_SCALE_SSD 10240. Size for the write rate an emergency checkpoint needs, not only for space."
  default     = 2560

  validation {
    condition     = var.filestore_capacity_gb == floor(var.filestore_capacity_gb) && var.filestore_capacity_gb >= 1024 && var.filestore_capacity_gb <= 102400
    error_message = "filestore_capacity_gb: a whole number of GiB from 1024 to 102400."
  }
}

variable "filestore_share_name" {
  type        = string
  description = "Name of the Filestore file share (the NFS export /<name>)."
  default     = "spottrain"

  validation {
    condition     = can(regex("^[a-z][a-z0-9_]{0,15}$", var.filestore_share_name))
    error_message = "filestore_share_name: 1-16 lowercase letters, digits and '_', starting with a letter."
  }
}

# ---------------------------------------------------------------------------------------------
# Optional controller VM
# ---------------------------------------------------------------------------------------------

variable "create_controller" {
  type        = bool
  description = "Create a small on-demand VM that runs the spottrain controller (so backfill does not depend on a workstation staying awake)."
  default     = false
}

variable "controller_machine_type" {
  type        = string
  description = "Machine type of the controller VM: it runs one Python process and no GPU."
  default     = "e2-small"

  validation {
    condition     = can(regex("^[a-z][a-z0-9]*-[a-z0-9-]+$", var.controller_machine_type)) && !can(regex("^(a2|a3|a4|g2)-", var.controller_machine_type))
    error_message = "controller_machine_type: a machine type such as e2-small; the controller needs no GPU."
  }
}

variable "controller_image" {
  type        = string
  description = "Boot image of the controller VM; it needs python3 >= 3.11 and gcloud (Debian 12 has both)."
  default     = "debian-cloud/debian-12"

  validation {
    condition     = can(regex("^(projects/[a-z][-a-z0-9]*/global/images/(family/)?[a-z][-a-z0-9]*|[a-z][-a-z0-9]*/[a-z][-a-z0-9]*)$", var.controller_image))
    error_message = "controller_image: give projects/PROJECT/global/images/family/FAMILY, projects/PROJECT/global/images/NAME, or PROJECT/FAMILY."
  }
}

variable "controller_job_spec" {
  type        = string
  description = "The text of the job spec the controller VM runs with `spottrain up` (-var \"controller_job_spec=$(cat job.yaml)\"), whose fleet: section names this module's group; empty to only install spottrain there. Its redis.password_file should be /etc/spottrain/redis-password, where the VM puts redis_password_secret."
  default     = ""

  validation {
    condition     = var.controller_job_spec == "" || can(keys(yamldecode(var.controller_job_spec)))
    error_message = "controller_job_spec: not a YAML mapping; give the job spec's text, not its path."
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
    # GCP metadata values hold up to 256 KB; the limit matches the AWS module's.
    condition     = length(var.env_lock) <= 16000
    error_message = "env_lock: longer than 16,000 characters (the AWS module's limit, kept the same here)."
  }
}
