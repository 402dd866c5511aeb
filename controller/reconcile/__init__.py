"""The reconcile controller of a launched fleet: observe (read-only), plan (pure), execute.

- :mod:`.types`: the planner's vocabulary (policy, observation, actions, plan).
- :mod:`.pricing`, :mod:`.fleet`, :mod:`.rules`, :mod:`.planner`: the pure planner, one
  function per rule; :mod:`.ledger`: the ledger's pure decisions (fold, redrive, bookkeeping).
- :mod:`.observe`: reads the clouds and Redis, writes nothing.
- :mod:`.execute`: the only code that acts on clouds and nodes (``end_run_vms`` for
  ``spottrain down`` included).
- :mod:`.records`, :mod:`.state`: the ledger as data and the run's state in Redis.
- :mod:`.controller`, :mod:`.drive`, :mod:`.summary`: a pass, passes under the run's lease,
  and the run's figures.
"""
