"""The local cloud: VMs as processes on this machine (:mod:`.compute`), their records
(:mod:`.records`) and the process that plays one VM (:mod:`.vm`, run as
``python -m spottrain.cloud.local.vm``; this package imports nothing so that it starts clean).
"""
