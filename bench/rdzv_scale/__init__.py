"""The simulated fleet of bench/rendezvous_scale.py, split by where the code runs: `worker`
(the processes that host the simulated nodes), `fleet` (the main process's handle on them and
the sampling monitor), `measure` (machine, Redis and CPU figures), `run` (the phases of one
fleet size) and `report` (the table and the JSON line)."""
