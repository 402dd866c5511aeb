"""The aws cloud: spot and on-demand GPU VMs on EC2 (:mod:`.compute`, with its settings,
error classification and launch parameters), Auto Scaling groups (:mod:`.group`) and S3
(:mod:`.s3`). boto3 is imported only when a client is built."""

from spottrain.cloud.aws.compute import AwsProvider
from spottrain.cloud.aws.settings import AwsSettings

__all__ = ["AwsProvider", "AwsSettings"]
