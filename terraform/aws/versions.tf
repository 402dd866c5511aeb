terraform {
  # The validations use startswith/endswith (1.3) and the lifecycle preconditions refuse
  # inconsistent inputs at plan time rather than half-way through an apply; 1.5 is the
  # oldest release this module is meant to be planned with.
  required_version = ">= 1.5.0, < 2.0.0"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 5.60+: aws_vpc_security_group_*_rule and the launch template's
      # instance_metadata_tags are stable there; a new major may rename attributes
      # (aws_region.name among them), so it is opted into by changing this line.
      version = "~> 5.60"
    }
  }
}
