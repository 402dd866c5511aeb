# An optional small on-demand VM for the spottrain controller, so the fleet does not depend
# on a workstation staying up. It installs the pinned spottrain; given a job spec, it starts
# `spottrain up` once, with the spec's fleet: section pointing at this module's group.

data "aws_ami" "controller" {
  count = var.create_controller && var.controller_ami_id == "" ? 1 : 0

  owners      = ["amazon"]
  most_recent = true

  filter {
    name   = "name"
    values = ["al2023-ami-2023.*-x86_64"]
  }
  filter {
    name   = "state"
    values = ["available"]
  }
}

locals {
  # The operator's spec with the fleet section this module owns (it adopts the group
  # instead of launching VMs); base64 so no character of the YAML can end a heredoc.
  controller_job_spec = var.controller_job_spec_yaml == "" ? "" : yamlencode(merge(
    yamldecode(var.controller_job_spec_yaml),
    { fleet = local.spottrain_fleet },
  ))
  controller_job_spec_b64 = local.controller_job_spec == "" ? "" : base64encode(local.controller_job_spec)

  # Replica mode with the lighthouse quorum: the controller starts and supervises the run's
  # torchft lighthouse (this venv's torchft_lighthouse), listening on lighthouse_port at this
  # VM's private address, which the fleet's agents are given as SPOTTRAIN_LIGHTHOUSE; the
  # controller's unit and operators' shells get the same address. Empty otherwise (elastic,
  # or the Redis quorum, which runs nothing here), so such a controller's user data is what
  # it was before replica mode existed (a change would stop and start it).
  controller_replica_setup = local.lighthouse ? local.controller_replica_script : ""
  controller_replica_script = <<-EOT
    if [ ! -x /opt/spottrain/venv/bin/torchft_lighthouse ]; then
      /opt/spottrain/venv/bin/pip install -q 'spottrain[aws]==${var.spottrain_version}'${local.replica_requirement}
    fi
    imds_token=$(curl -sSf -m 5 -X PUT http://169.254.169.254/latest/api/token -H 'X-aws-ec2-metadata-token-ttl-seconds: 300')
    private_ip=$(curl -sSf -m 5 -H "X-aws-ec2-metadata-token: $imds_token" http://169.254.169.254/latest/meta-data/local-ipv4)
    [[ "$private_ip" =~ ^[0-9]+[.][0-9]+[.][0-9]+[.][0-9]+$ ]] || { echo "spottrain: instance metadata gave the address '$private_ip'" >&2; exit 1; }
    echo "export SPOTTRAIN_LIGHTHOUSE=$private_ip:${var.lighthouse_port}" >>/etc/profile.d/spottrain.sh
    install -d -m 0755 /etc/systemd/system/spottrain-controller.service.d
    printf '[Service]\nEnvironment=SPOTTRAIN_LIGHTHOUSE=%s:${var.lighthouse_port}\n' "$private_ip" >/etc/systemd/system/spottrain-controller.service.d/lighthouse.conf
  EOT

  # `spottrain up` starts a new run each time it runs, so the unit runs it until it has
  # succeeded once on this VM (the marker file); after a reboot an operator restarts the
  # controller with `spottrain resume --detach`. Type=oneshot + RemainAfterExit keeps the detached
  # controller in the unit's cgroup, so stopping the unit stops it.
  controller_user_data = <<-EOT
    #!/bin/bash
    # spottrain ${var.spottrain_version}: the controller VM of run ${var.run_id}.
    set -euo pipefail
    exec >>/var/log/spottrain-controller-boot.log 2>&1
    if [ ! -x /opt/spottrain/venv/bin/spottrain ]; then
      python=$(command -v python3.12 || command -v python3.11 || true)
      if [ -z "$python" ]; then
        dnf install -y -q python3.11
        python=$(command -v python3.11)
      fi
      "$python" -m venv /opt/spottrain/venv
      /opt/spottrain/venv/bin/pip install -q 'spottrain[aws]==${var.spottrain_version}'
    fi
    ln -sf /opt/spottrain/venv/bin/spottrain /usr/local/bin/spottrain
    install -d -m 0755 /etc/spottrain
    install -d -m 0700 /var/lib/spottrain
    cat > /etc/profile.d/spottrain.sh <<'PROFILE'
    export SPOTTRAIN_HOME=/var/lib/spottrain
    export AWS_DEFAULT_REGION=${local.region}
    PROFILE
    ${local.controller_replica_setup}JOB_SPEC_B64='${local.controller_job_spec_b64}'
    if [ -n "$JOB_SPEC_B64" ]; then
      umask 077
      echo "$JOB_SPEC_B64" | base64 -d > /etc/spottrain/job.yaml
      umask 022
      cat > /etc/systemd/system/spottrain-controller.service <<'UNIT'
    [Unit]
    Description=spottrain controller of run ${var.run_id}
    Wants=network-online.target
    After=network-online.target
    ConditionPathExists=!/var/lib/spottrain/.up-started

    [Service]
    Type=oneshot
    RemainAfterExit=yes
    Environment=SPOTTRAIN_HOME=/var/lib/spottrain
    Environment=AWS_DEFAULT_REGION=${local.region}
    ExecStart=/opt/spottrain/venv/bin/spottrain up /etc/spottrain/job.yaml --detach
    ExecStartPost=/usr/bin/touch /var/lib/spottrain/.up-started

    [Install]
    WantedBy=multi-user.target
    UNIT
      systemctl daemon-reload
      systemctl enable --now spottrain-controller.service
    fi
  EOT
}

resource "aws_instance" "controller" {
  count = var.create_controller ? 1 : 0

  ami                    = var.controller_ami_id != "" ? var.controller_ami_id : data.aws_ami.controller[0].id
  instance_type          = var.controller_instance_type
  subnet_id              = var.subnet_ids[0]
  vpc_security_group_ids = [aws_security_group.controller[0].id]
  iam_instance_profile   = aws_iam_instance_profile.controller[0].name
  key_name               = var.key_name == "" ? null : var.key_name
  user_data_base64       = base64encode(local.controller_user_data)

  metadata_options {
    http_endpoint = "enabled"
    http_tokens   = "required"
    # No containers here: the credentials stay on the VM itself.
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "enabled"
  }

  root_block_device {
    volume_size           = 30
    volume_type           = "gp3"
    encrypted             = true
    delete_on_termination = true
  }

  tags        = merge(local.tags, { Name = "${local.name}-controller" })
  volume_tags = merge(local.tags, { Name = "${local.name}-controller" })

  lifecycle {
    # A newer Amazon Linux release must not replace a controller in the middle of a run.
    ignore_changes = [ami]

    # The workers' integration is the agent's (integration): the spec's must be the same.
    precondition {
      condition     = var.controller_job_spec_yaml == "" || try(yamldecode(var.controller_job_spec_yaml).train.integration, "sdk") == var.integration
      error_message = "controller_job_spec_yaml: its train.integration must match integration (${var.integration}); change whichever is wrong."
    }

    # The controller runs the spec while the fleet boots from these variables: a spec in
    # another mode would drive VMs that train differently from what it plans for.
    precondition {
      condition = var.controller_job_spec_yaml == "" || (
        try(yamldecode(var.controller_job_spec_yaml).train.fault_tolerance, "elastic") == var.fault_tolerance &&
        try(yamldecode(var.controller_job_spec_yaml).train.replica.nodes_per_replica, 1) == var.nodes_per_replica &&
        try(yamldecode(var.controller_job_spec_yaml).train.replica.min_replicas, 1) == var.min_replicas &&
        try(yamldecode(var.controller_job_spec_yaml).train.replica.quorum, "redis") == var.replica_quorum &&
        try(yamldecode(var.controller_job_spec_yaml).train.replica.wait_replicas, 0) == var.replica_wait_replicas &&
        # "auto" on both sides, or the same number (the spec's 5 is tfvars' "5" or "5.0"); with
        # the lighthouse (no timeout here) the spec may spell out its own fixed 1 s.
        (
          try(tostring(yamldecode(var.controller_job_spec_yaml).train.replica.heartbeat_timeout_s), "auto") == var.replica_heartbeat_timeout_s ||
          try(tonumber(yamldecode(var.controller_job_spec_yaml).train.replica.heartbeat_timeout_s) == tonumber(var.replica_heartbeat_timeout_s), false) ||
          (var.replica_quorum == "lighthouse" && var.replica_heartbeat_timeout_s == "auto" && try(tonumber(yamldecode(var.controller_job_spec_yaml).train.replica.heartbeat_timeout_s) == 1, false))
        ) &&
        try(tostring(yamldecode(var.controller_job_spec_yaml).train.replica.join_timeout_ms), "auto") == var.replica_join_timeout_ms &&
        try(tostring(yamldecode(var.controller_job_spec_yaml).train.replica.relay_group_size), "auto") == var.replica_relay_group_size
      )
      error_message = "controller_job_spec_yaml: its train.fault_tolerance and train.replica must match fault_tolerance (${var.fault_tolerance}), nodes_per_replica (${var.nodes_per_replica}), min_replicas (${var.min_replicas}), replica_quorum (${var.replica_quorum}), replica_wait_replicas (${var.replica_wait_replicas}), replica_heartbeat_timeout_s (${var.replica_heartbeat_timeout_s}), replica_join_timeout_ms (${var.replica_join_timeout_ms}) and replica_relay_group_size (${var.replica_relay_group_size}); change whichever is wrong."
    }
  }
}
