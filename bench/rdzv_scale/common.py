"""What every part of the rendezvous scale bench shares: its timing constants and phases."""

POLL_INTERVAL_S = 0.1  # torchrun's agent monitor interval
TORCH_KEEP_ALIVE_S = 5  # torch's default keep_alive_interval
HEARTBEAT_TIMEOUT_S = 5  # ours: keep_alive_interval 1 s x keep_alive_max_attempt 5

PHASES = ("form", "steady", "reform")


class PhaseTimeout(RuntimeError):
    """A phase of the benchmark did not finish in time."""
