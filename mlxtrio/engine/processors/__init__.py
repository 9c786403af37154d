"""Logits processors: what shapes each sequence's next token, on the engine
thread. :mod:`.assembly` builds a sequence's list from its sampling
parameters; :mod:`.steps` is how a processor knows the tokens generated so far
without making the engine wait for the device."""
