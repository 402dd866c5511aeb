"""The agent that runs on every VM: rendezvous, preemption watchers, torchrun launch."""
