terraform {
  # 1.5 brought startswith(), which main.tf uses; lifecycle preconditions need 1.2.
  required_version = ">= 1.5.0, < 2.0.0"

  required_providers {
    # Everything here is GA in the google provider; google-beta is not needed. 6.x has the
    # MIG's instance_lifecycle_policy.force_update_on_repair and Filestore's ZONAL tier.
    google = {
      source  = "hashicorp/google"
      version = "~> 6.0"
    }
  }
}

# This folder is a root module (`terraform apply` here provisions one run's fleet), so it
# configures its provider; every resource also names project and zone explicitly, so a
# provider default can never put part of the fleet somewhere else.
provider "google" {
  project = var.project
  region  = local.region
  zone    = var.zone
}
