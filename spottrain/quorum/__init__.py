"""The replica quorum kept in the run's Redis (``train.replica.quorum: redis``).

It replaces torchft's lighthouse: the state is persisted with the run's Redis, quorum ids
come from a counter that never goes back, a replica can leave explicitly, and each step costs
O(1) bytes per replica on the wire (the full membership travels only when it changes).

Modules: :mod:`.model` (members, answers, the config), :mod:`.errors`, :mod:`.scripts` (the
Lua that owns every key), :mod:`.client` (the blocking client the agent's lighthouse shim
and the benchmark use). The key layout under ``RunKeys.quorum_base`` is described in
:mod:`.scripts`.
"""
