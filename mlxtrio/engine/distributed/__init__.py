"""One model across the ranks of a distributed world (``mlx.launch``).

:mod:`.world` (joining, collectives), :mod:`.ranks` (opening the model's
shards), :mod:`.lockstep` (every rank applies the same commands at the same
safepoints), :mod:`.follower` (the engine of ranks other than 0),
:mod:`.doorbell` (idle ranks wait without spinning); the commands' wire form
is in :mod:`mlxtrio.engine.commands`."""
