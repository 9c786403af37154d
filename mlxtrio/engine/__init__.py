"""Everything that touches MLX: one engine per loaded model, one thread each.

The top level is the core: :mod:`.engine` (the Trio-facing :class:`~.engine.Engine`:
submit, lookup, lifecycle), :mod:`.loop` (the engine thread's serving loop over
mlx-lm's ``BatchGenerator``), :mod:`.handle` (one generation, seen from Trio),
:mod:`.commands` and :mod:`.schedule` (what crosses to the engine thread, and
when), :mod:`.types` (plain data both sides read), :mod:`.model` (loading),
:mod:`.supervisor` (states, restarts, world failure), :mod:`.config`,
:mod:`.sequence`, :mod:`.pacing`, :mod:`.sizing`, :mod:`.precision`,
and :mod:`.memory`.

By ownership:

* :mod:`.cache` - the prefix KV cache (its README says which module runs on
  which thread);
* :mod:`.processors` - logits processors: openings, reasoning budget, grammar
  masks, sampling, and their assembly per sequence;
* :mod:`.distributed` - one model across the ranks of ``mlx.launch``.

Threading contract: only the engine thread touches MLX state; the Trio side
puts commands on a queue (never blocking) and receives one batch of events per
engine step. Nothing here imports the API, HTTP or store layers.
"""
