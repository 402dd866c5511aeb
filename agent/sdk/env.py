"""The environment variables the SDK reads (set by the agent, torchrun and the job spec)."""

ENV_CKPT_DIR = "SPOTTRAIN_CKPT_DIR"
ENV_REDIS = "SPOTTRAIN_REDIS"
ENV_ROUND = "SPOTTRAIN_RDZV_ROUND"
ENV_NODE = "SPOTTRAIN_NODE_ID"
ENV_COPY_TO = "SPOTTRAIN_CKPT_COPY_TO"
