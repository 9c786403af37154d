"""Tiny random-weight models whose prompt cache cannot be trimmed.

The prefix cache reuses a cached prompt by trimming its KV cache back to the
shared prefix. Two kinds of real models cannot be trimmed that way, and the
engine must handle them without trimming (reuse only exact snapshots, or
prefill from scratch):

* ``kind="ssm"``: a Qwen3.5-style hybrid (mlx-lm's ``qwen3_5``, dense): three
  Gated DeltaNet (linear-attention) layers, whose recurrent state lives in an
  ``ArraysCache`` (never trimmable), and one full-attention layer with a
  ``KVCache``. Its cache is untrimmable from the start.
* ``kind="sliding"``: a Gemma 3 text model (mlx-lm's ``gemma3_text``) whose
  sliding layers use a ``RotatingKVCache`` with a window of :data:`WINDOW`
  tokens, alternating with global ``KVCache`` layers. mlx-lm counts a rotating
  cache trimmable only while it has not wrapped (``offset < max_size``), so the
  cache becomes untrimmable once a prompt is longer than the window.

Unlike ``tests/scripted_model.py`` the output is not scripted: the weights are
random (fixed seed, so every build is identical) at about the scale of the
layers' own initialisers, small enough that float32 and bfloat16 stay finite,
tuned so that tokens hundreds of positions back still change greedy output. Tests
compare outputs of one model with itself (e.g. a cached against an uncached
run), never with fixed text. The tokenizer, chat template and special tokens
are the embedded model's, so the engine loads these like any model through
``mlx_lm.load``; each builds in well under a second.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mlxtrio.settings import EMBEDDED_MODEL_PATH

WINDOW = 64  # sliding-window size of the "sliding" model, in tokens
SEED = 1234
SSM_MIXER_GAIN = 4.0  # scale of the ssm model's attention / DeltaNet output projections
SLIDING_QK_GAIN = 3.0  # RMSNorm scale of the sliding model's queries and keys
KINDS = ("ssm", "sliding")

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def _ssm_config(vocab_size: int) -> dict[str, Any]:
    # Layers 0-2 are Gated DeltaNet, layer 3 full attention (interval 4, as
    # Qwen3.5). Key/value head dims of 32 keep the Metal kernel path usable.
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 65536,
        "rope_parameters": {
            "type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def _sliding_config(vocab_size: int) -> dict[str, Any]:
    # Layers 0 and 2 slide over WINDOW tokens, layers 1 and 3 are global.
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "max_position_embeddings": 65536,
        "torch_dtype": "float32",
    }


def build_hybrid(out: Path, kind: str = "ssm") -> Path:
    """Write the tiny ``kind`` model (``"ssm"`` or ``"sliding"``) to ``out``
    and return it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text, qwen3_5
    from tokenizers import Tokenizer

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    out.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copy(EMBEDDED_MODEL_PATH / name, out / name)
    tokenizer = Tokenizer.from_file(str(EMBEDDED_MODEL_PATH / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = json.loads((EMBEDDED_MODEL_PATH / "config.json").read_text())["eos_token_id"]

    if kind == "ssm":
        config = _ssm_config(vocab_size)
        module: Any = qwen3_5
    else:
        config = _sliding_config(vocab_size)
        module = gemma3_text
    config["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(config, indent=2))

    # Parameters are drawn by the layers' own initialisers (Linear: uniform
    # +-1/sqrt(fan_in); Embedding: normal, std 1/sqrt(hidden)), seeded, then a
    # few are adjusted so the output depends on more than the last few tokens
    # (with the plain initialisers a change 50 tokens back rarely changes
    # greedy output, which makes cache mix-ups invisible).
    mx.random.seed(SEED)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for name, value in weights.items():
        if kind == "ssm":
            if name.endswith(("o_proj.weight", "out_proj.weight")):
                # Louder mixers against the residual stream (the token embedding).
                weights[name] = value * SSM_MIXER_GAIN
            elif name.endswith("A_log"):
                # Slow decay: the recurrent state remembers hundreds of tokens.
                weights[name] = mx.log(mx.random.uniform(0.05, 0.3, value.shape))
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            # Gemma's RMSNorm scales by 1 + weight: sharper attention than
            # the near-uniform average random queries and keys give.
            weights[name] = mx.full(value.shape, SLIDING_QK_GAIN - 1.0)
        elif name.endswith("norm.weight"):
            weights[name] = mx.zeros_like(value)  # scale 1, as checkpoints store
    if kind == "sliding":
        weights.pop("lm_head.weight")  # tied: sanitize() drops the head
    mx.save_safetensors(
        str(out / "model.safetensors"),
        {k: v.astype(mx.float32) for k, v in weights.items()},
        metadata={"format": "mlx"},
    )
    return out
