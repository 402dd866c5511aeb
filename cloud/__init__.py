"""Cloud providers behind one interface: aws (boto3), gcp (google-cloud-compute), local."""
