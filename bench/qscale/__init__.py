"""The parts of ``bench/quorum_scale.py``: one module per quorum implementation measured
(:mod:`qscale.lighthouse`, the stock torchft lighthouse; the Redis quorum in
:mod:`qscale.redis_quorum` with its server, client and heartbeat processes, script calls,
measurements and report in ``qscale/redis_*.py``), the measurement every thread-per-client
implementation shares (:mod:`qscale.rounds`), the process-group rebuild (:mod:`qscale.pg`)
and the fits (:mod:`qscale.fit`)."""
