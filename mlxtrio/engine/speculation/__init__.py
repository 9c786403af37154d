"""Speculative decoding inside the batch: model-free drafts, verified several
tokens at a time, each row rolled back on its own.

* :mod:`.drafts` proposes a sequence's next tokens from its own prompt and
  output (prompt lookup: the latest earlier occurrence of its last few tokens);
  pure Python, no MLX;
* :mod:`.policy` decides how many tokens each row drafts (from its recent
  acceptance) and whether drafting pays at all (from the step times measured
  on this machine); pure Python;
* :mod:`.rollback` takes each row's rejected tokens back out of mlx-lm's batch
  KV cache;
* :mod:`.verify` is mlx-lm's ``GenerationBatch`` with a speculative step.

Everything but the first two runs on the engine thread only.
"""
