"""A model that writes a given passage, at the bench model's size: the stand-in
for a coding model that copies what it was shown.

    python benchmarks/copier_model.py OUT_DIR

A Qwen3 at the dimensions of the benchmarks' ``small`` model (8 layers, hidden
512, 8 query and 4 KV heads of 64, MLP 1536; the embedded tokenizer), so that a
decode step costs what that model's does. Its weights are set by hand, not
trained: one attention head of its first layer looks exactly
:data:`DISTANCE` positions back and the output layer writes the token it finds
there. So the model writes what stands :data:`DISTANCE` tokens before the point
it writes at: a *script* placed at the end of the last message
(:func:`script_text`) is what it answers, token by token, then it ends its turn.

The script is written in *shadow* tokens (``<|c17|>`` stands for token 17):
the model reads them as the tokens they shadow, but nothing else can, so the
prompt-lookup drafts see only the conversation itself (the file the agent
read, the earlier calls) and are accepted exactly as often as the answer
really repeats them: an Edit call repeating the lines it replaces, a patch its
context lines, a file rewritten with small changes. The other heads and layers
hold random weights whose outputs are zeroed: they cost their compute and
change nothing.

How the head finds its position: its query and key are the embedding's
constant dimension, turned by RoPE; the query is turned back by
:data:`DISTANCE` positions beforehand, so query and key line up only there.
RoPE's base is 1e12 and only its 8 fastest frequency pairs are used: the score
peaks sharply at that distance and stays low elsewhere over any context.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxtrio.settings import EMBEDDED_MODEL_PATH  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 512, 8, 8, 4, 64, 1536
ROPE_THETA = 1e12
DISTANCE = 1536  # how far back the model reads what it writes
CONST = 0  # residual dimensions: a constant, a token's code, the code copied
CODE, COPIED = slice(64, 128), slice(128, 192)
POSITION_PAIRS = 8  # the fastest RoPE pairs
SHARPNESS = 6.0  # q_norm/k_norm weights: the score's peak over its neighbours


def shadow(token: int) -> str:
    return f"<|c{token}|>"


def script_text(tokenizer: Any, answer: str, after: int) -> str:
    """The text to end the last message with so that the model answers
    ``answer``: its tokens in shadow, then shadow end-of-turn tokens up to
    :data:`DISTANCE` before the model's first token. ``after`` is how many
    prompt tokens the chat template puts after the message (the end of the
    message, the assistant's header). Raises ValueError when the answer is
    too long for the distance."""
    ids = tokenizer.encode(answer, add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The last prompt token's output is the script's first token: the script
    # starts DISTANCE tokens before it.
    padding = DISTANCE + 1 - len(ids) - after
    if padding < 1:
        raise ValueError(f"an answer of {len(ids)} tokens does not fit {DISTANCE}")
    return "".join(shadow(t) for t in [*ids, *[end] * padding])


def build(out: Path, seed: int = 0) -> Path:
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    out.mkdir(parents=True, exist_ok=True)
    for name in EMBEDDED_MODEL_PATH.iterdir():
        if name.suffix != ".safetensors" and name.name != "config.json" and name.is_file():
            shutil.copy(name, out / name.name)
    base, vocab = _write_tokenizer(out)
    config = json.loads((EMBEDDED_MODEL_PATH / "config.json").read_text())
    config.update(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        intermediate_size=MLP,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=False,
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))

    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    codes = np.random.default_rng(seed).standard_normal((base, CODE.stop - CODE.start))
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)

    embed = np.zeros((vocab, HIDDEN), dtype=np.float32)
    embed[:, CONST] = 1.0
    embed[:base, CODE] = codes
    embed[base : 2 * base, CODE] = codes  # a shadow reads as the token it shadows
    weights["model.embed_tokens.weight"] = embed
    head = np.zeros((vocab, HIDDEN), dtype=np.float32)
    head[:base, COPIED] = codes * 8.0  # only real tokens are ever written
    weights["lm_head.weight"] = head

    for name in weights:  # every output off but the head's below
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name][:] = 0.0
    half = HEAD_DIM // 2
    omega = ROPE_THETA ** (-np.arange(half) * 2.0 / HEAD_DIM)
    key = np.zeros(HEAD_DIM)
    key[:POSITION_PAIRS] = 1.0
    # RoPE turns pair i by position * omega[i]; the query starts DISTANCE back.
    x, y = key[:half], key[half:]
    angle = -DISTANCE * omega
    query = np.concatenate(
        [x * np.cos(angle) - y * np.sin(angle), x * np.sin(angle) + y * np.cos(angle)]
    )
    a = "model.layers.0.self_attn."
    q_proj, k_proj, v_proj = (weights[a + n + "_proj.weight"] for n in "qkv")
    q_proj[:HEAD_DIM] = k_proj[:HEAD_DIM] = v_proj[:HEAD_DIM] = 0.0
    q_proj[:HEAD_DIM, CONST] = query
    k_proj[:HEAD_DIM, CONST] = key
    v_proj[:HEAD_DIM, CODE] = np.eye(HEAD_DIM)
    weights[a + "q_norm.weight"][:] = SHARPNESS
    weights[a + "k_norm.weight"][:] = SHARPNESS
    # Undo the input norm (the residual holds two unit parts).
    weights[a + "o_proj.weight"][COPIED, :HEAD_DIM] = np.eye(HEAD_DIM) * np.sqrt(2 / HIDDEN)

    mx.save_safetensors(
        str(out / "model.safetensors"),
        {k: mx.array(v).astype(mx.float32) for k, v in weights.items()},
        metadata={"format": "mlx"},
    )
    return out


def _write_tokenizer(out: Path) -> tuple[int, int]:
    """The embedded tokenizer plus a shadow of each of its tokens (special:
    one token each, never split); returns (its own size, the new size)."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(EMBEDDED_MODEL_PATH / "tokenizer.json"))
    base = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    shadows = [AddedToken(shadow(t), special=True, normalized=False) for t in range(base)]
    tokenizer.add_special_tokens(shadows)
    assert tokenizer.token_to_id(shadow(0)) == base, "shadows must follow the vocabulary"
    tokenizer.save(str(out / "tokenizer.json"))
    return base, 2 * base


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.split("\n\n")[1])
    print(build(Path(sys.argv[1])))
