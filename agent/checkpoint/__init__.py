"""Checkpoints that survive a crash at any instant: DCP shards, a manifest with checksums,
an atomic rename, a ``latest`` pointer, and a fencing epoch per generation of writers."""
