"""The controller of a fleet that a cloud group owns: its pure planner and its loop."""
