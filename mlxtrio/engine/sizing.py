"""How many sequences an engine decodes at once when ``CAPACITY`` is auto.

Batched decode is nearly free per extra sequence on the models mlxtrio runs
locally (a step reads the weights once for the whole batch), so the more
sequences run together, the more tokens per second the server gives out:
measured on a 2-core CPU (``benchmarks/results/capacity-small.md``, a 29 M
parameter Qwen3), 8 concurrent streams got 67 tokens/s at capacity 4, 120 at
8 and 129 at 16, and 16 streams 73, 122 and 195; the time to a first token
at 8 streams fell from 3.4 s to 0.7 s (a stream beyond the capacity waits for
a slot). What bounds it is memory: every running sequence holds its own KV,
which for an 8B model in bfloat16 is ~150 KB a token, 1.2 GB for 8k tokens.
So auto gives the running sequences a quarter of the machine's memory at
:data:`TYPICAL_CONTEXT` tokens each, within [:data:`MIN_CAPACITY`,
:data:`MAX_CAPACITY`]: 16 for the embedded model anywhere, 14 for an 8B model
on a 64 GB Mac, 4 on a 16 GB one. Pure arithmetic on the model's config.
"""

from __future__ import annotations

from typing import Any

from ..settings import physical_memory

MIN_CAPACITY = 4
MAX_CAPACITY = 16
TYPICAL_CONTEXT = 8192  # tokens of KV a running sequence is planned for
MEMORY_SHARE = 0.25  # of physical memory, for the running sequences' KV


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int | None:
    """Bytes of KV one token takes in every layer (None: the config does not say)."""
    text = config.get("text_config") or config
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text.get("num_key_value_heads") or text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    width = 4 if dtype == "float32" else 2
    return layers * heads * head_dim * 2 * width  # keys and values


def auto_capacity(config: dict[str, Any], dtype: str, memory: int | None = None) -> int:
    per_token = kv_bytes_per_token(config, dtype)
    if not per_token:
        return MIN_CAPACITY * 2
    budget = (memory or physical_memory()) * MEMORY_SHARE
    fits = int(budget // (per_token * TYPICAL_CONTEXT))
    return max(MIN_CAPACITY, min(MAX_CAPACITY, fits))
