# A 2-8 node A3 fleet in us-central1-a, training from a pinned git commit, checkpoints on a
# zonal Filestore and copied to Cloud Storage. Copy this file, change the values, then:
#   terraform init && terraform apply -var-file=my.tfvars

project    = "acme-train"
zone       = "us-central1-a"
run_id     = "gpt-1b3-2025-07"
network    = "spottrain"
subnetwork = "spottrain-us-central1"

machine_type = "a3-highgpu-8g"
# Any Debian/Ubuntu image with the NVIDIA driver, python3 >= 3.11 and gcloud.
image        = "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accelerator-2404-amd64-with-nvidia-570"
boot_disk_gb = 200

initial_size = 2
nnodes_min   = 2
nnodes_max   = 8

spottrain_version = "0.1.0"
git_repo          = "https://github.com/acme/gpt-train"
git_commit        = "9fceb02d0ae598e95dc970b74767f19372d61af8"
train_command     = ["train.py", "--model", "1.3b", "--name", "gpt 1.3b"]

checkpoint_copy_to    = "gs://acme-spottrain/gpt-1b3"
filestore_tier        = "ZONAL"
filestore_capacity_gb = 2560

redis_url             = "redis://10.0.0.5:6379"
redis_password_secret = "spottrain-redis-password"
redis_port            = 6379
redis_target_tags     = ["spottrain-redis"]
controller_cidrs      = ["10.8.0.0/24"] # the office VPN

# A controller VM in the zone that runs `spottrain up` on the job spec. A .tfvars file holds
# values only (no file()), so pass the spec on the command line:
#   terraform apply -var-file=my.tfvars -var "controller_job_spec=$(cat gpt-1b3.yaml)"
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
