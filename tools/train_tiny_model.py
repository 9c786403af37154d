"""Train the embedded tiny chat model (``mlxtrio/assets/tiny-chat``).

    make train            # or: python tools/train_tiny_model.py --seed 0

``make train`` runs two stages (the README's run 27): a base from random
weights, its first steps with bf16 products (``--bf16 mlp,proj --bf16-steps``),
then a short float32 fine-tune of it (``--init-from``) with real-world text in
half the prompts (``--foreign-ratio``) and softened attention (``--soften``).

Reproducible: the data, the tokenizer and the initial weights all come from
``--seed``. Trains a Qwen3-architecture network in PyTorch on the CPU (much faster
than MLX's CPU backend here), then writes weights in mlx-lm's ``qwen3`` layout
with the tokenizer, config and chat template from ``build_embedded_model.py``, so
``mlx_lm.load`` serves it like any other model. Loss is on the assistant
completion only. Needs ``torch`` (``pip install torch==2.13.0``) and
``transformers`` (an mlx-lm dependency).
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

import build_embedded_model as build  # noqa: E402
import tinychat_data as data  # noqa: E402
from foreign_text import ForeignText, add_foreign_context  # noqa: E402

OUT = Path(__file__).parent.parent / "mlxtrio" / "assets" / "tiny-chat"

# jemalloc keeps freed blocks for reuse instead of returning them to the kernel.
JEMALLOC_CONF = (
    "oversize_threshold:1,background_thread:true,metadata_thp:auto,"
    "dirty_decay_ms:-1,muzzy_decay_ms:-1"
)


def rerun_under_jemalloc() -> None:
    """Restart this process with jemalloc preloaded, where Linux has it installed.

    bf16 autocast makes and drops bf16 copies of weights and activations at
    every step. glibc's malloc serves blocks that large straight from the kernel
    and gives them back on free, so each step faults in fresh zeroed pages:
    about 15 % of the CPU time went to the kernel. Under jemalloc a bf16 chat step
    takes 1.2 s instead of 1.56 s on 2 cores (float32 steps: no change). Does
    nothing when jemalloc is missing (e.g. macOS) or already loaded.
    """
    if sys.platform != "linux" or "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        return
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        print("jemalloc not found (apt-get install libjemalloc2): bf16 steps are slower")
        return
    preload = " ".join(filter(None, [library, os.environ.get("LD_PRELOAD")]))
    env = {**os.environ, "LD_PRELOAD": preload, "MALLOC_CONF": JEMALLOC_CONF}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


# -- the model: mlx-lm's qwen3, in PyTorch ------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * self.weight


def bf16_products(scopes: frozenset[str], scope: str):
    """bf16 autocast for the matrix products of ``scope`` ("mlp" or "proj"), if it
    is one of ``scopes`` (``--bf16 mlp,proj``); a no-op context otherwise. Outside
    these regions attention and the output layer stay float32."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=scope in scopes)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-traditional RoPE (rotate halves), as mlx.nn.RoPE(traditional=False)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, c: dict, bf16: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.bf16 = bf16
        h, nh, nkv, hd = (
            c["hidden_size"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            c["head_dim"],
        )
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.gate_proj = nn.Linear(h, c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(h, c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], h, bias=False)
        self.input_layernorm = RMSNorm(h, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(h, c["rms_norm_eps"])

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        softness: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, n, _ = x.shape
        y = self.input_layernorm(x)
        with bf16_products(self.bf16, "proj"):
            q, k, v = self.q_proj(y), self.k_proj(y), self.v_proj(y)
        # bf16 products come back in bf16; attention and the residual stream stay float32.
        q = self.q_norm(q.float().view(b, n, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(k.float().view(b, n, self.nkv, self.hd)).transpose(1, 2)
        v = v.float().view(b, n, self.nkv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if softness is not None:  # scales this row's attention scores (see --soften)
            q = q * softness[:, None, None, None]
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with bf16_products(self.bf16, "proj"):
            out = self.o_proj(attn.transpose(1, 2).reshape(b, n, -1))
        x = x + out.float()
        y = self.post_attention_layernorm(x)
        with bf16_products(self.bf16, "mlp"):
            out = self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return x + out.float()


class TinyQwen3(nn.Module):
    def __init__(self, c: dict, bf16: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c, bf16) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        for layer in self.layers:
            for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.gate_proj, layer.up_proj):
                nn.init.normal_(lin.weight, std=0.02)
            for lin in (layer.o_proj, layer.down_proj):  # scaled residual init
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * c["num_hidden_layers"]))

    @torch.no_grad()
    def init_previous_token_head(self, gain: float = 2.5, pairs: int = 4) -> None:
        """Start head 0 of layer 0 as a previous-token head.

        Copying a name from the prompt needs an induction circuit: a head that
        moves each token's identity one position on (previous-token head) and a
        later head that attends to "the position after an earlier copy of my
        token". Trained from random weights on this data, it never formed (the
        model predicted the marginal over name words; even pure copy tasks sat
        at chance for hundreds of steps). So the first half is built in:

        * every token embedding gets the same value in dimension 0, a constant
          direction after the input norm (invisible in the output: tied
          embeddings add the same logit to every token);
        * head 0's query and its key head read only that direction, so they are
          the same vector at every position, and RoPE alone shapes the score;
        * on the ``pairs`` fastest rotating RoPE pairs the key is turned one
          step ahead of the query, so every pair peaks at the previous position;
        * its value ignores the constant direction (else it would carry little
          but the constant) and its output starts at full scale, so the copied
          token identity is as loud in the residual stream as the token's own.

        The weights stay trainable; this is an initialisation, not a constraint.
        """
        c = self.c
        hd, half = c["head_dim"], c["head_dim"] // 2
        self.embed_tokens.weight[:, 0] = 1.0
        layer = self.layers[0]
        layer.q_proj.weight[:hd].zero_()
        layer.k_proj.weight[:hd].zero_()
        layer.v_proj.weight[:hd].normal_(0.0, 1.0 / math.sqrt(c["hidden_size"]))
        layer.v_proj.weight[:hd, 0] = 0.0
        layer.o_proj.weight[:, :hd].normal_(0.0, 0.02)
        for i in range(pairs):
            theta = c["rope_theta"] ** (-i / half)
            layer.q_proj.weight[i, 0] = 1.0
            layer.k_proj.weight[i, 0] = math.cos(theta)
            layer.k_proj.weight[i + half, 0] = math.sin(theta)
            for norm in (layer.q_norm, layer.k_norm):
                norm.weight[i] = norm.weight[i + half] = gain

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
        softness: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every position of ``ids``, or only at ``positions`` (flat
        indices into batch x sequence): the output layer is a quarter of the
        model's work, and most positions of a batch carry little or no loss.

        ``rope_positions`` (batch x sequence) are the positions RoPE rotates by;
        default ``0..n-1`` in every row (see ``skip_positions``). ``softness``
        (one factor per row) scales every attention score of that row."""
        n, hd = ids.shape[1], self.c["head_dim"]
        inv = 1.0 / (
            self.c["rope_theta"] ** (torch.arange(0, hd // 2, dtype=torch.float32) / (hd // 2))
        )
        if rope_positions is None:
            angles = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
        else:  # one row of angles per sequence, broadcast over the heads
            angles = rope_positions.float()[:, None, :, None] * inv
        cos, sin = (
            angles.cos().to(self.embed_tokens.weight.dtype),
            angles.sin().to(self.embed_tokens.weight.dtype),
        )
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, softness)
        x = self.norm(x)
        if positions is not None:
            x = x.reshape(-1, x.shape[-1])[positions]
        return x @ self.embed_tokens.weight.T  # tied embeddings

    @property
    def bf16(self) -> frozenset[str]:
        return self.layers[0].bf16

    def to_float32(self, compile: bool) -> nn.Module:
        """Drop the bf16 products (``--bf16-steps``): the model to step from now on,
        recompiled if ``compile`` (the compiled graph has the bf16 casts baked in).

        Precision matters most late: in every run with bf16 products to the end
        (18, 19, 26) the base's selection collapsed, while the loss fell as fast
        as in float32."""
        for layer in self.layers:
            layer.bf16 = frozenset()
        if not compile:
            return self
        torch._dynamo.reset()
        return torch.compile(self, dynamic=True)

    def mlx_state(self) -> dict[str, torch.Tensor]:
        """Weights under mlx-lm's qwen3 names."""
        return {
            k: v.detach().to(torch.bfloat16).contiguous() for k, v in self._by_mlx_name().items()
        }

    @torch.no_grad()
    def load_mlx_state(self, path: Path) -> None:
        """Start from weights this class wrote (``model.safetensors``)."""
        from safetensors.torch import load_file

        saved = load_file(str(path))
        for name, parameter in self._by_mlx_name().items():
            parameter.copy_(saved[name].to(parameter.dtype))

    def _by_mlx_name(self) -> dict[str, torch.Tensor]:
        out = {
            "model.embed_tokens.weight": self.embed_tokens.weight,
            "model.norm.weight": self.norm.weight,
        }
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                out[p + f"self_attn.{name}.weight"] = getattr(layer, name).weight
            for name in ("gate_proj", "up_proj", "down_proj"):
                out[p + f"mlp.{name}.weight"] = getattr(layer, name).weight
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        return out


# -- data ---------------------------------------------------------------------


# A training item: token ids and the loss weight of predicting ids[a:b], per range.
Item = tuple[list[int], list[tuple[int, int, float]]]


def encode(
    tokenizer,
    sample: data.Sample,
    eos: int,
    max_len: int,
    prompt_weight: float,
    call_weight: float = 1.0,
    name_weight: float | None = None,
) -> Item | None:
    """Prompt + completion + EOS ids; the completion weighs 1, the prompt
    ``prompt_weight``, tokens inside ``<tool_call>…</tool_call>`` ``call_weight``,
    and those of the called tool's name ``name_weight`` (default: ``call_weight``).

    A small prompt weight also asks the model to predict the prompt's own
    repetitions, e.g. parameter names in ``required``. A call weight above 1
    puts more of the loss on what must be read from the prompt (the tool name,
    parameter names, argument values): once the format is learnt, those are
    nearly all the loss left in a call.
    """
    # The same call mlx-lm's TokenizerWrapper makes, so training sees exactly the
    # token ids the server will render.
    prompt = tokenizer.apply_chat_template(
        sample.messages,
        tools=sample.tools,
        add_generation_prompt=True,
        enable_thinking=sample.thinking,
        tokenize=True,
        return_dict=False,
    )
    encoded = tokenizer(sample.completion, add_special_tokens=False, return_offsets_mapping=True)
    completion = list(encoded["input_ids"]) + [eos]
    ids = list(prompt) + completion
    if len(ids) > max_len:
        return None
    start = len(prompt)
    ranges = [(1, start, prompt_weight), (start, len(ids), 1.0)]
    offsets = encoded["offset_mapping"]
    spans = [(a, b, call_weight) for a, b in _call_spans(sample.completion)]
    if name_weight is not None:  # after the calls': later ranges win
        spans += [(a, b, name_weight) for a, b in _name_spans(sample.completion)]
    for a, b, weight in spans:
        inside = [i for i, (x, y) in enumerate(offsets) if x < b and y > a]
        if inside and weight != 1.0:
            ranges.append((start + inside[0], start + inside[-1] + 1, weight))
    return ids, ranges


def _name_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the called tools' names (with their closing quote)."""
    spans = []
    for a, b in _call_spans(text):
        head = text.find('"name": "', a, b)
        if head >= 0:
            head += len('"name": "')
            spans.append((head, text.find('"', head, b) + 1))
    return spans


def _call_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the tool calls' JSON bodies in a completion."""
    spans, at = [], 0
    while (head := text.find("<tool_call>", at)) >= 0:
        tail = text.find("</tool_call>", head)
        spans.append((head + len("<tool_call>"), tail))
        at = tail
    return spans


def copy_item(rng: random.Random, tokenizer, vocab: int, first: int) -> Item:
    """A pure copying exercise, so that induction heads form.

    The chat data alone never taught the model to copy (it predicted the marginal
    over tool-name words, not the name in its prompt): a name is a few tokens in a
    long sample. Here most of the loss is on copying.
    """
    if rng.random() < 0.5:
        return span_item(rng, vocab, first)
    return recall_item(rng, tokenizer)


def span_item(rng: random.Random, vocab: int, first: int) -> Item:
    """Random tokens, then a span of random tokens repeated back to back; loss on
    the repeats. Several repeats give the induction circuit a dense signal."""
    span = [rng.randrange(first, vocab) for _ in range(rng.randint(4, 32))]
    noise = [rng.randrange(first, vocab) for _ in range(rng.randint(0, 200))]
    ids = noise + span * rng.randint(2, 6)
    return ids, [(len(noise) + len(span) + 1, len(ids), 1.0)]


def repeat_item(rng: random.Random, vocab: int, first: int, length: int = 128) -> Item:
    """A short span of random tokens repeated to ``length``: the densest copying
    signal, for the warm-up (with a previous-token head to start from, a 4-layer
    model learns induction from these in ~500 steps of 32 sequences)."""
    span = [rng.randrange(first, vocab) for _ in range(rng.randint(8, 16))]
    ids = (span * (length // len(span) + 1))[:length]
    return ids, [(len(span) + 1, length, 1.0)]


def recall_item(rng: random.Random, tokenizer) -> Item:
    """Key/value recall shaped like a tool list (``description: name`` lines),
    then queried keys; loss on the names recalled."""
    pairs: dict[str, str] = {}
    size = rng.randint(2, 12)
    while len(pairs) < size:
        key = " ".join(rng.choice(data.COPY_KEY_WORDS) for _ in range(rng.randint(1, 4)))
        pairs[key] = data.novel_name(rng)
    keys = list(pairs)
    ids = tokenizer.encode(
        "".join(f"{k}: {pairs[k]}\n" for k in keys) + "\n", add_special_tokens=False
    )
    ranges = []
    for key in rng.sample(keys, k=rng.randint(1, len(keys))):
        ids += tokenizer.encode(f"{key}:", add_special_tokens=False)
        value = tokenizer.encode(f" {pairs[key]}\n", add_special_tokens=False)
        ranges.append((len(ids), len(ids) + len(value), 1.0))
        ids += value
    return ids, ranges


def batches(encoded: list[Item], tokens_per_batch: int, rng: random.Random):
    """Length-bucketed batches of about ``tokens_per_batch`` (padded) tokens, forever."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    groups, current, longest = [], [], 0
    for i in order:
        longest = max(longest, len(encoded[i][0]))
        if current and longest * (len(current) + 1) > tokens_per_batch:
            groups.append(current)
            current, longest = [], len(encoded[i][0])
        current.append(i)
    groups.append(current)
    while True:
        rng.shuffle(groups)
        yield from groups


def collate(encoded: list[Item], group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ids, next-token targets and per-position loss weights."""
    n = max(len(encoded[i][0]) for i in group)
    ids = torch.zeros(len(group), n, dtype=torch.long)
    targets = torch.zeros((len(group), n), dtype=torch.long)
    weights = torch.zeros((len(group), n), dtype=torch.float32)
    for row, i in enumerate(group):
        seq, ranges = encoded[i]
        ids[row, : len(seq)] = torch.tensor(seq)
        # predict token t+1 from position t
        targets[row, : len(seq) - 1] = torch.tensor(seq[1:])
        for a, b, weight in ranges:
            weights[row, a - 1 : b - 1] = weight
    return ids, targets, weights


def system_prompt_end(tokenizer, sample: data.Sample) -> int:
    """About where the system prompt's own text ends in the rendered prompt (the
    tool list and the conversation follow it); 1 without a system prompt."""
    first = sample.messages[0]
    if first["role"] != "system":
        return 1
    return len(
        tokenizer.encode("<|im_start|>system\n" + first["content"], add_special_tokens=False)
    )


def skip_positions(
    encoded: list[Item],
    group,
    length: int,
    context_ends: list[int],
    rng: random.Random,
    ratio: float,
    reach: int,
) -> torch.Tensor:
    """RoPE positions for a batch, with a jump in some system prompts (PoSE).

    Real agent prompts run to ~20k tokens, training samples to 4k. RoPE scores
    depend only on the distance between positions, so skipping the positions
    after a point by up to ``reach`` minus the sample's length shows the model
    every distance up to ``reach`` at the cost of a 4k sample.

    The point falls in the system prompt's text (before ``context_ends[i]``), as
    in a real agent prompt, where the long part is the system prompt and the tool
    list sits close to the request (with jumps anywhere, run 12's selection fell
    to 47 %: likely, a jump inside the tool list made the tools before it look far
    off). Run 13 trained this way and still rambled on 20k prompts, so distances
    are not the whole story (see the README). ``ratio`` of the chat items
    (``encoded[:len(context_ends)]``) jump; the rest, and the copying exercises,
    count ``0..n-1``.
    """
    rows = torch.arange(length).repeat(len(group), 1)
    for row, i in enumerate(group):
        seq = encoded[i][0]
        if i >= len(context_ends) or reach <= len(seq) or rng.random() >= ratio:
            continue
        split = rng.randint(1, context_ends[i])
        rows[row, split:] += rng.randint(0, reach - len(seq))
    return rows


def soften_attention(rows: int, lowest: float, generator: torch.Generator) -> torch.Tensor:
    """A factor in ``[lowest, 1]`` per row, to scale that row's attention scores by.

    On a prompt eight times its longest training sample (Claude Code's 34k
    tokens), the model rambled: every head's softmax spreads over eight times
    as many keys, and the few that matter lose their share. Scoring the real
    request at a higher attention temperature proved the point (the README's
    lessons), but one fixed temperature helped at 34k tokens and broke 16k ones.
    Training with softer attention in some rows teaches the heads wider margins
    between the keys that matter and the rest, which is what a long prompt asks
    of them; at a factor of 1 nothing changes, so short prompts stay in the
    training distribution.
    """
    return lowest + (1.0 - lowest) * torch.rand(rows, generator=generator)


def sample_loss_positions(
    weights: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions to compute the loss at, and their weights: a position of weight
    ``w < 1`` (the prompt's) is kept with probability ``w`` at weight 1, one of
    weight ``w >= 1`` always, at ``w``; weight 0 (padding) never. Each position's
    expected weight is unchanged, so is the expected gradient, and the output layer
    runs on far fewer positions. The noisier prompt gradient cost selection dearly
    (run 11 in the README), so this is off by default."""
    flat = weights.reshape(-1)
    kept = torch.rand(flat.shape, generator=generator) < flat.clamp(max=1.0)
    positions = kept.nonzero().squeeze(1)
    return positions, flat[positions].clamp(min=1.0)


class NameProbe:
    """Teacher-forced check that the model copies tool names from its prompt.

    On held-out tool calls (eval names, never trained on): the mean log-prob of
    the called name's tokens, and how often every name token is the argmax. A
    model that has not learnt to copy sits near log(1 / name-word pool), ~ -4.
    """

    def __init__(self, tokenizer, eos: int, seed: int, n: int = 40) -> None:
        rng = random.Random(seed)
        vocab, first = len(tokenizer), len(build.SPECIAL_TOKENS)
        self.spans = [span_item(rng, vocab, first) for _ in range(n // 2)]
        self.recalls = [recall_item(rng, tokenizer) for _ in range(n // 2)]
        self.items: list[tuple[list[int], int, int]] = []
        marker = '<tool_call>{"name": "'
        while len(self.items) < n:
            sample = data.make_sample(rng, split="eval", long_ratio=0.0)
            if sample.kind != "tool" or sample.thinking:
                continue
            item = encode(tokenizer, sample, eos, 4096, 0.0)
            assert item is not None
            ids, ranges = item
            prompt_len = ranges[1][0]
            head = sample.completion.index(marker) + len(marker)
            tail = head + len(sample.expected_tools[0])
            a = prompt_len + len(
                tokenizer.encode(sample.completion[:head], add_special_tokens=False)
            )
            b = prompt_len + len(
                tokenizer.encode(sample.completion[:tail], add_special_tokens=False)
            )
            self.items.append((ids, a, b))

    @staticmethod
    def _logprob(model: nn.Module, items: list[Item]) -> float:
        total, count = 0.0, 0
        for ids, ranges in items:
            logits = model(torch.tensor([ids]))[0].float().log_softmax(-1)
            for a, b, _ in ranges:
                picked = logits[a - 1 : b - 1].gather(1, torch.tensor(ids[a:b])[:, None])
                total += picked.sum().item()
                count += b - a
        return total / count

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> str:
        spans, recalls = self._logprob(model, self.spans), self._logprob(model, self.recalls)
        logprob, exact, count = 0.0, 0, 0
        for ids, a, b in self.items:
            logits = model(torch.tensor([ids[:b]]))[0].float().log_softmax(-1)
            targets = torch.tensor(ids[a:b])
            picked = logits[a - 1 : b - 1].gather(1, targets[:, None])
            logprob += picked.sum().item()
            count += b - a
            exact += int(bool((logits[a - 1 : b - 1].argmax(-1) == targets).all()))
        return (
            f"probe log-prob/token: copy span {spans:.2f}, recall {recalls:.2f}, "
            f"tool name {logprob / count:.2f} (names exact {exact}/{len(self.items)})"
        )


def bf16_scopes(value: str) -> frozenset[str]:
    """Parse ``--bf16``'s value: "all", or a comma-separated subset of mlp, proj."""
    scopes = frozenset(part.strip() for part in value.split(","))
    if scopes == {"all"} or (scopes and scopes <= {"mlp", "proj"}):
        return scopes
    raise argparse.ArgumentTypeError(f"{value!r}: expected 'all' or a subset of 'mlp,proj'")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=30000)
    parser.add_argument("--steps", type=int, default=1300)
    parser.add_argument("--tokens-per-batch", type=int, default=8192)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--prompt-weight", type=float, default=0.0, help="loss weight of prompt tokens"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the model with Inductor (float32 unless --bf16; about 2x faster on "
        "a CPU than the default, bf16 autocast in eager mode)",
    )
    parser.add_argument(
        "--bf16",
        nargs="?",
        const="all",
        type=bf16_scopes,
        default=frozenset(),
        metavar="SCOPES",
        help="with --compile: bf16 matrix products (float32 accumulation and weights). "
        "Alone: bf16 autocast over the whole model (runs 18, 19); or a comma-separated "
        "subset of 'mlp' and 'proj' (attention's projections), keeping attention and "
        "the output layer in float32",
    )
    parser.add_argument(
        "--bf16-steps",
        type=int,
        default=None,
        help="with --bf16 SCOPES: only the first this many steps, float32 after them",
    )
    parser.add_argument(
        "--variety", action="store_true", help="fresh tool names and values per sample"
    )
    parser.add_argument("--long-ratio", type=float, default=0.03)
    parser.add_argument(
        "--copy-samples", type=int, default=0, help="copying exercises mixed into the data"
    )
    parser.add_argument(
        "--copy-warmup", type=int, default=0, help="first steps on copying exercises only"
    )
    parser.add_argument(
        "--warmup-lr", type=float, default=None, help="peak learning rate of the copy warm-up"
    )
    parser.add_argument(
        "--call-weight", type=float, default=1.0, help="loss weight of tool-call tokens"
    )
    parser.add_argument(
        "--name-weight",
        type=float,
        default=None,
        help="loss weight of the called tool's name (default: --call-weight)",
    )
    parser.add_argument(
        "--prev-token-init",
        action="store_true",
        help="start layer 0's head 0 as a previous-token head (see init_previous_token_head)",
    )
    parser.add_argument(
        "--description-first",
        action="store_true",
        help="render each tool with its description before its name (experiment)",
    )
    parser.add_argument(
        "--names-in-reasoning",
        action="store_true",
        help="reasoning names the tool it calls (runs 1-9; see tinychat_data.make_sample)",
    )
    parser.add_argument(
        "--sample-prompt-loss",
        action="store_true",
        help="compute the prompt's loss on a random sample of its positions "
        "(see sample_loss_positions): 20%% faster chat steps, but held-out selection "
        "fell from 84%% to 46%% (run 11 in the README)",
    )
    parser.add_argument(
        "--skip-ratio",
        type=float,
        default=0.0,
        help="share of chat samples whose prompt positions jump ahead (see skip_positions)",
    )
    parser.add_argument(
        "--skip-reach", type=int, default=24576, help="largest position a jump reaches"
    )
    parser.add_argument(
        "--soften",
        type=float,
        default=1.0,
        help="scale each sample's attention scores in the chat phase by a factor drawn from "
        "[SOFTEN, 1] (see soften_attention); 1 leaves them alone",
    )
    parser.add_argument(
        "--two-call-ratio",
        type=float,
        default=0.2,
        help="how often a request offering several tools asks for two calls",
    )
    parser.add_argument(
        "--foreign-ratio",
        type=float,
        default=0.0,
        help="share of chat samples given real-world text in their prompt "
        "(see foreign_text.add_foreign_context)",
    )
    parser.add_argument(
        "--foreign-chars",
        type=int,
        default=4000,
        help="longest foreign system prompt, in characters",
    )
    parser.add_argument(
        "--foreign-tools", type=int, default=6, help="most distractor tools of foreign text"
    )
    parser.add_argument(
        "--foreign-tool-chance",
        type=float,
        default=0.3,
        help="how often a foreign sample offering tools gets distractor tools",
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        help="continue from the model in this directory (its weights and tokenizer) "
        "instead of random weights and a fresh tokenizer; --prev-token-init is then moot",
    )
    parser.add_argument("--probe-every", type=int, default=100)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.init_from and not (args.init_from / "model.safetensors").is_file():
        parser.error(f"--init-from {args.init_from}: no model.safetensors there")
    if not 0.0 < args.soften <= 1.0:
        parser.error(f"--soften {args.soften}: the lowest factor must be in (0, 1]")
    if args.bf16_steps is not None and not args.bf16 - {"all"}:
        parser.error("--bf16-steps needs --bf16 with scopes (mlp, proj)")
    if args.bf16:
        rerun_under_jemalloc()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    if args.init_from:
        # The tokenizer, config and template come along; the weights are loaded below.
        if args.init_from.resolve() != args.out.resolve():
            for file in args.init_from.iterdir():
                if file.is_file() and file.name != "model.safetensors":
                    shutil.copy(file, args.out / file.name)
    else:
        build.build_tokenizer(
            args.out,
            args.seed,
            data.corpus(args.seed + 1, 4000, args.variety, args.names_in_reasoning),
        )
        build.write_config(args.out)
    if args.description_first:
        build.write_template(args.out, build.CHAT_TEMPLATE_DESCRIPTION_FIRST)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.out))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    encoded, context_ends = [], []
    # Its own stream (like skip_rng below), so runs without it draw as before.
    foreign_rng = random.Random(args.seed + 13)
    foreign = ForeignText("train") if args.foreign_ratio else None
    while len(encoded) < args.samples:
        sample = data.make_sample(
            rng,
            long_ratio=args.long_ratio,
            variety=args.variety,
            names_in_reasoning=args.names_in_reasoning,
            two_call_ratio=args.two_call_ratio,
        )
        prompt_weight = args.prompt_weight
        if foreign is not None and foreign_rng.random() < args.foreign_ratio:
            add_foreign_context(
                sample,
                foreign,
                foreign_rng,
                args.foreign_chars,
                args.foreign_tools,
                args.foreign_tool_chance,
            )
            # Learning to predict Python's sources is no use to the model, and
            # their many prompt tokens would dilute the completion's share of the loss.
            prompt_weight = 0.0
        item = encode(
            tokenizer,
            sample,
            eos,
            args.max_len,
            prompt_weight,
            args.call_weight,
            args.name_weight,
        )
        if item is not None:
            encoded.append(item)
            context_ends.append(system_prompt_end(tokenizer, sample) if args.skip_ratio else 1)
    first = len(build.SPECIAL_TOKENS)
    copies = [copy_item(rng, tokenizer, len(tokenizer), first) for _ in range(args.copy_samples)]
    encoded += copies
    total = sum(len(s) for s, _ in encoded)
    print(
        f"data: {len(encoded)} samples, {total} tokens, longest {max(len(s) for s, _ in encoded)} "
        f"({time.monotonic() - started:.0f} s)",
        flush=True,
    )

    config = json.loads((args.out / "config.json").read_text())
    model = TinyQwen3(config, args.bf16 - {"all"})
    if args.init_from:
        model.load_mlx_state(args.init_from / "model.safetensors")
    elif args.prev_token_init:
        model.init_previous_token_head()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, args.steps // 30)
    # Inducing copying from the previous-token head wants a gentler rate than the
    # chat phase can take (--warmup-lr); the cosine runs over all steps either way.
    warm_scale = (args.warmup_lr or args.lr) / args.lr
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * (warm_scale if s < args.copy_warmup else 1.0)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
        ),
    )
    # --compile: compiled by Inductor; on a CPU about twice as fast as bf16 autocast
    # in eager mode (small matrices, many elementwise ops to fuse). --bf16 adds bf16
    # matrix products to it: a third less time per step (under jemalloc).
    step_model = torch.compile(model, dynamic=True) if args.compile else model
    stream = batches(encoded, args.tokens_per_batch, rng)
    # The warm-up: dense repeats in small batches (many cheap steps).
    warm = [
        repeat_item(rng, len(tokenizer), first) for _ in range(20000 if args.copy_warmup else 0)
    ]
    warmup_stream = batches(warm, 4096, rng) if args.copy_warmup else None
    probe = NameProbe(tokenizer, eos, args.seed + 7)
    loss_sampler = torch.Generator().manual_seed(args.seed)
    # Its own stream, so runs without jumps draw exactly what they always did.
    skip_rng = random.Random(args.seed + 11)
    soften_rng = torch.Generator().manual_seed(args.seed + 19)
    seen, loss_avg, t0 = 0, None, time.monotonic()
    last_at = t0  # time of the last progress line
    for step in range(1, args.steps + 1):
        if step - 1 == args.bf16_steps and model.bf16:
            step_model = model.to_float32(args.compile)
        rope_positions = softness = None
        if warmup_stream is not None and step <= args.copy_warmup:
            ids, targets, weights = collate(warm, next(warmup_stream))
        else:
            group = next(stream)
            ids, targets, weights = collate(encoded, group)
            if args.skip_ratio:
                rope_positions = skip_positions(
                    encoded,
                    group,
                    ids.shape[1],
                    context_ends,
                    skip_rng,
                    args.skip_ratio,
                    args.skip_reach,
                )
            if args.soften < 1.0:
                softness = soften_attention(len(group), args.soften, soften_rng)
        if args.sample_prompt_loss:
            positions, weights = sample_loss_positions(weights, loss_sampler)
            targets = targets.reshape(-1)[positions]
        else:
            positions = None
        with torch.autocast(
            "cpu", dtype=torch.bfloat16, enabled="all" in args.bf16 or not args.compile
        ):
            logits = step_model(ids, positions, rope_positions, softness)
        per_token = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
        )
        loss = (per_token * weights.reshape(-1)).sum() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        seen += ids.numel()
        loss_avg = loss.item() if loss_avg is None else 0.98 * loss_avg + 0.02 * loss.item()
        if step % 50 == 0 or step == args.steps:
            elapsed = time.monotonic() - t0
            print(
                f"step {step}/{args.steps} loss {loss_avg:.4f} lr {schedule.get_last_lr()[0]:.2e} "
                f"{seen / elapsed:.0f} tok/s, {elapsed / 60:.1f} min "
                # from the recent pace: warm-up steps are cheaper than chat steps
                f"(about {(time.monotonic() - last_at) / 50 * (args.steps - step) / 60:.0f} min left)",
                flush=True,
            )
            last_at = time.monotonic()
        if step % args.probe_every == 0 or step == args.steps:
            model.eval()
            probe_started = time.monotonic()
            report = probe(model)
            print(f"{report} ({time.monotonic() - probe_started:.1f} s)", flush=True)
            model.train()

    from safetensors.torch import save_file

    save_file(model.mlx_state(), str(args.out / "model.safetensors"), metadata={"format": "mlx"})
    size = (args.out / "model.safetensors").stat().st_size
    print(
        f"wrote {args.out} ({size / 1e6:.1f} MB weights) in {(time.monotonic() - started) / 60:.1f} min",
        flush=True,
    )


if __name__ == "__main__":
    main()
