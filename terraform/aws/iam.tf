# Two roles, each with only what its process calls, on only this run's resources. The
# agent needs no ec2:DescribeTags: the run's tags reach it through instance metadata
# (instance_metadata_tags), and everything else through /etc/spottrain/agent.env.

data "aws_iam_policy_document" "ec2_assume" {
  statement {
    sid     = "Ec2AssumesTheRole"
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

# --- the agents ------------------------------------------------------------------------------

resource "aws_iam_role" "agent" {
  # A prefix, not the run id: role names stop at 64 characters.
  name_prefix        = "spottrain-agent-"
  description        = "spottrain agents of run ${var.run_id}"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
  tags               = local.tags
}

resource "aws_iam_instance_profile" "agent" {
  name_prefix = "spottrain-agent-"
  role        = aws_iam_role.agent.name
  tags        = local.tags
}

data "aws_iam_policy_document" "agent" {
  # The dead man's switch: a VM whose controller is gone and whose training stopped
  # terminates itself (a shutdown from inside a container cannot). Only VMs tagged with this
  # run: code on one of them could end another of the run's VMs, nothing else.
  statement {
    sid       = "EndItselfAmongThisRunsVMs"
    actions   = ["ec2:TerminateInstances"]
    resources = ["arn:${local.partition}:ec2:${local.region}:${local.account_id}:instance/*"]

    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/spottrain-job"
      values   = [var.run_id]
    }
  }

  # After its emergency checkpoint commits, the agent completes the termination hook's
  # action; the heartbeat lets it hold the VM longer for a checkpoint that needs it.
  statement {
    sid = "DrainThroughTheLifecycleHook"
    actions = [
      "autoscaling:CompleteLifecycleAction",
      "autoscaling:RecordLifecycleActionHeartbeat",
    ]
    resources = [local.asg_arn]
  }

  # The boot script fetches the Redis password into a root-only file; the secret itself
  # never travels in user data.
  dynamic "statement" {
    for_each = var.redis_password_secret_arn == "" ? [] : [var.redis_password_secret_arn]

    content {
      sid       = "ReadTheRedisPassword"
      actions   = ["secretsmanager:GetSecretValue"]
      resources = [statement.value]
    }
  }

  # The job's secrets (secret_env_arns, git_token_secret_arn), which the boot reads into
  # root-only files the same way: exactly these ARNs, none other.
  dynamic "statement" {
    for_each = length(local.job_secret_arns) == 0 ? [] : [local.job_secret_arns]

    content {
      sid       = "ReadTheJobsSecrets"
      actions   = ["secretsmanager:GetSecretValue"]
      resources = statement.value
    }
  }

  dynamic "statement" {
    for_each = var.code_archive_url == "" ? [] : [local.code_archive_object]

    content {
      sid       = "ReadTheCodeArchive"
      actions   = ["s3:GetObject"]
      resources = [statement.value]
    }
  }

  # Checkpoint copies: this run's objects only, so a VM cannot touch other runs' copies.
  dynamic "statement" {
    for_each = local.copy_to == "" ? [] : [local.copy_run_objects]

    content {
      sid = "CopyThisRunsCheckpoints"
      actions = [
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
      ]
      resources = [statement.value]
    }
  }

  # Key names only, no content. Without s3:ListBucket S3 answers 403 instead of 404 for a
  # key that does not exist, and the agent would read "access denied" where it must read
  # "no copy yet" (its first copy, a fresh restore).
  dynamic "statement" {
    for_each = local.copy_to == "" ? [] : [local.copy_bucket]

    content {
      sid       = "ListTheCopyBucket"
      actions   = ["s3:ListBucket"]
      resources = ["arn:${local.partition}:s3:::${statement.value}"]
    }
  }

  dynamic "statement" {
    for_each = length(var.kms_key_arns) == 0 ? [] : [var.kms_key_arns]

    content {
      sid       = "UseTheKeysThroughSecretsManagerAndS3"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = statement.value

      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = ["secretsmanager.${local.region}.amazonaws.com", "s3.${local.region}.amazonaws.com"]
      }
    }
  }
}

resource "aws_iam_role_policy" "agent" {
  name   = "spottrain-agent"
  role   = aws_iam_role.agent.id
  policy = data.aws_iam_policy_document.agent.json
}

resource "aws_iam_role_policy_attachment" "agent_ssm" {
  count = var.enable_ssm ? 1 : 0

  role       = aws_iam_role.agent.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

# --- the controller VM -----------------------------------------------------------------------

resource "aws_iam_role" "controller" {
  count = var.create_controller ? 1 : 0

  name_prefix        = "spottrain-controller-"
  description        = "spottrain controller of run ${var.run_id}"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
  tags               = local.tags
}

resource "aws_iam_instance_profile" "controller" {
  count = var.create_controller ? 1 : 0

  name_prefix = "spottrain-controller-"
  role        = aws_iam_role.controller[0].name
  tags        = local.tags
}

data "aws_iam_policy_document" "controller" {
  # Describe calls take no resource-level permissions in IAM: "*" here is the only resource
  # EC2 and Auto Scaling accept for them, and they read, never change.
  statement {
    sid = "ObserveTheFleetAndOffers"
    actions = [
      "autoscaling:DescribeAutoScalingGroups",
      "autoscaling:DescribeAutoScalingInstances",
      "autoscaling:DescribeLifecycleHooks",
      "autoscaling:DescribeScalingActivities",
      "ec2:DescribeInstances",
      "ec2:DescribeInstanceTypes",
      "ec2:DescribeInstanceTypeOfferings",
      "ec2:DescribeSpotPriceHistory",
      "ec2:DescribeAvailabilityZones",
    ]
    resources = ["*"]
  }

  # The controller owns the group's size and chooses which VM leaves.
  statement {
    sid = "SizeThisRunsGroup"
    actions = [
      "autoscaling:SetDesiredCapacity",
      "autoscaling:TerminateInstanceInAutoScalingGroup",
      "autoscaling:SetInstanceProtection",
      "autoscaling:CompleteLifecycleAction",
    ]
    resources = [local.asg_arn]
  }

  # A VM that never came up healthy: the controller reads its console for the boot's
  # failure line (spottrain-boot: ... failed in '<stage>'), only of VMs tagged with this run.
  statement {
    sid       = "ReadTheConsoleOfThisRunsVMs"
    actions   = ["ec2:GetConsoleOutput"]
    resources = ["arn:${local.partition}:ec2:${local.region}:${local.account_id}:instance/*"]

    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/spottrain-job"
      values   = [var.run_id]
    }
  }

  # Ending a VM that never came up healthy: only VMs tagged with this run.
  statement {
    sid       = "EndOnlyThisRunsVMs"
    actions   = ["ec2:TerminateInstances"]
    resources = ["arn:${local.partition}:ec2:${local.region}:${local.account_id}:instance/*"]

    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/spottrain-job"
      values   = [var.run_id]
    }
  }

  dynamic "statement" {
    for_each = var.redis_password_secret_arn == "" ? [] : [var.redis_password_secret_arn]

    content {
      sid       = "ReadTheRedisPassword"
      actions   = ["secretsmanager:GetSecretValue"]
      resources = [statement.value]
    }
  }

  # `spottrain up` uploads the code archive under <copy_to>/code/ and a job move reads
  # the copies: the whole prefix, not just this run's part of it.
  dynamic "statement" {
    for_each = local.copy_to == "" ? [] : [local.copy_prefix_objects]

    content {
      sid = "UseTheCopyPrefix"
      actions = [
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
      ]
      resources = [statement.value]
    }
  }

  dynamic "statement" {
    for_each = local.copy_to == "" ? [] : [local.copy_bucket]

    content {
      sid       = "ListTheCopyBucket"
      actions   = ["s3:ListBucket"]
      resources = ["arn:${local.partition}:s3:::${statement.value}"]
    }
  }

  dynamic "statement" {
    for_each = length(var.kms_key_arns) == 0 ? [] : [var.kms_key_arns]

    content {
      sid       = "UseTheKeysThroughSecretsManagerAndS3"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = statement.value

      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = ["secretsmanager.${local.region}.amazonaws.com", "s3.${local.region}.amazonaws.com"]
      }
    }
  }
}

resource "aws_iam_role_policy" "controller" {
  count = var.create_controller ? 1 : 0

  name   = "spottrain-controller"
  role   = aws_iam_role.controller[0].id
  policy = data.aws_iam_policy_document.controller.json
}

resource "aws_iam_role_policy_attachment" "controller_ssm" {
  count = var.create_controller && var.enable_ssm ? 1 : 0

  role       = aws_iam_role.controller[0].name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}
