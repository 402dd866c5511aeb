"""torchft's lighthouse protocol served from the run's Redis (``train.replica.quorum:
redis``): each VM's agent runs a :class:`~.server.LighthouseShim` on a local port and points
its workers' ``TORCHFT_LIGHTHOUSE`` at it, so torchft's Rust manager stays unchanged while
the quorum lives in Redis (:mod:`spottrain.quorum`).

Modules: :mod:`.proto` (torchft's lighthouse messages, declared with protobuf's descriptor
API), :mod:`.roster` (the full participant list rebuilt from a cached roster; its cost:
``python -m spottrain.agent.quorum_shim.roster``) and :mod:`.server` (the gRPC service, the
coalesced heartbeats and the leave).
"""
