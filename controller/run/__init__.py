"""A run: its records, code, boot scripts, provider wiring, drive loop, archive and daemon."""
