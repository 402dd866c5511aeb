"""VMs in a box: spottrain's real boot scripts run in sandboxed VMs (Linux namespaces) against
the cloud fakes; see :mod:`.hypervisor` for the machines and :mod:`.ec2_front` for what they
reach as AWS."""
