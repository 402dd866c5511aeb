"""The controller: job spec, fleet state in Redis, the planner and the reconcile loop."""
