"""What the parts of spottrain say to each other through Redis and the environment, in one
place on the floor (agent, controller and cloud all read the same copy):

- :mod:`spottrain.protocol.keys`: the Redis key schema of a run (:class:`RunKeys`);
- :mod:`spottrain.protocol.env`: the ``SPOTTRAIN_*`` environment variable names;
- :mod:`spottrain.protocol.states`: node states and their moves, run phases, ledger statuses;
- :mod:`spottrain.protocol.events`: the event stream's envelope, its writer and its reader;
- :mod:`spottrain.protocol.notices`: injected notices.
"""
