"""What the parts of spottrain say to each other through Redis, in one place on the floor.

Today: injected notices (:mod:`spottrain.protocol.notices`).
"""
