"""The parts of ``bench/quorum_scale.py``: one module per quorum implementation measured
(:mod:`qscale.lighthouse`, the stock torchft lighthouse), the measurement every
implementation shares (:mod:`qscale.rounds`), the process-group rebuild
(:mod:`qscale.pg`) and the fits (:mod:`qscale.fit`)."""
