"""What every generation route shares, whatever API it speaks.

* :mod:`.pipeline` - :func:`~.pipeline.prepare`: resolve the model, render,
  budget the output, plan its constraints, take an admission place, look up
  the prefix cache, in that order; then :meth:`~.pipeline.PreparedTurn.run`.
* :mod:`.stream` - the one streaming producer, and the guarantee that every
  stream ends with exactly one terminal event.
* :mod:`.call` - one API call's scope (nursery, cleanups, access record).
* :mod:`.services` - the server's long-lived parts: engines, admission lanes,
  store, jobs, metrics.
* :mod:`.models` (which engine serves a name), :mod:`.admission` (capacity
  lanes, 429), :mod:`.jobs` (work that outlives its request).
"""
