"""The parts of ``bench/quorum_scale.py``: one module per quorum implementation measured
(:mod:`qscale.lighthouse`, the stock torchft lighthouse; the Redis quorum in
:mod:`qscale.redis_quorum` with its server, client and heartbeat processes, script calls,
measurements and report in ``qscale/redis_*.py``), the measurement every thread-per-client
implementation shares (:mod:`qscale.rounds`), the process-group rebuild (:mod:`qscale.pg`)
the fits (:mod:`qscale.fit`), and the Redis CPU of one script call at N members
(:mod:`qscale.script_cost`, run on its own) and of a round through relays
(:mod:`qscale.relay_cost`, run on its own; the bench's relayed rounds are in
:mod:`qscale.redis_relays`)."""
