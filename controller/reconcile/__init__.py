"""The reconcile controller of a launched fleet: observe (read-only), plan (pure), execute
(the only code that acts on clouds and nodes)."""
