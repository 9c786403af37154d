"""Train the embedded tiny chat model (``mlxtrio/assets/tiny-chat``).

    make train            # or: python tools/train_tiny_model.py --seed 0

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
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

import build_embedded_model as build  # noqa: E402
import tinychat_data as data  # noqa: E402

OUT = Path(__file__).parent.parent / "mlxtrio" / "assets" / "tiny-chat"


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


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-traditional RoPE (rotate halves), as mlx.nn.RoPE(traditional=False)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        y = self.input_layernorm(x)
        q = self.q_norm(self.q_proj(y).view(b, n, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(y).view(b, n, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(y).view(b, n, self.nkv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, n, -1))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class TinyQwen3(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        for layer in self.layers:
            for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.gate_proj, layer.up_proj):
                nn.init.normal_(lin.weight, std=0.02)
            for lin in (layer.o_proj, layer.down_proj):  # scaled residual init
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * c["num_hidden_layers"]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n, hd = ids.shape[1], self.c["head_dim"]
        inv = 1.0 / (
            self.c["rope_theta"] ** (torch.arange(0, hd // 2, dtype=torch.float32) / (hd // 2))
        )
        angles = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
        cos, sin = (
            angles.cos().to(self.embed_tokens.weight.dtype),
            angles.sin().to(self.embed_tokens.weight.dtype),
        )
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x) @ self.embed_tokens.weight.T  # tied embeddings

    def mlx_state(self) -> dict[str, torch.Tensor]:
        """Weights under mlx-lm's qwen3 names."""
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
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


# -- data ---------------------------------------------------------------------


def encode(tokenizer, sample: data.Sample, eos: int, max_len: int) -> tuple[list[int], int] | None:
    """(prompt + completion + EOS ids, index where the completion starts)."""
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
    completion = tokenizer.encode(sample.completion, add_special_tokens=False) + [eos]
    ids = list(prompt) + completion
    if len(ids) > max_len:
        return None
    return ids, len(prompt)


def batches(encoded: list[tuple[list[int], int]], tokens_per_batch: int, rng: random.Random):
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


def collate(
    encoded, group, prompt_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ids, next-token targets and per-position loss weights.

    The completion carries full weight, prompt tokens ``prompt_weight`` (0, the
    default, trains on the completion only; a small weight also asks the model to
    predict the prompt's own repetitions, e.g. parameter names in ``required``).
    """
    n = max(len(encoded[i][0]) for i in group)
    ids = torch.zeros(len(group), n, dtype=torch.long)
    targets = torch.zeros((len(group), n), dtype=torch.long)
    weights = torch.zeros((len(group), n), dtype=torch.float32)
    for row, i in enumerate(group):
        seq, start = encoded[i]
        ids[row, : len(seq)] = torch.tensor(seq)
        # predict token t+1 from position t
        targets[row, : len(seq) - 1] = torch.tensor(seq[1:])
        weights[row, : start - 1] = prompt_weight
        weights[row, start - 1 : len(seq) - 1] = 1.0
    return ids, targets, weights


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
        help="float32 compiled by Inductor (about 2x faster on a CPU than the default "
        "bf16 autocast in eager mode; not what trained the shipped weights)",
    )
    parser.add_argument(
        "--variety", action="store_true", help="fresh tool names and values per sample"
    )
    parser.add_argument("--long-ratio", type=float, default=0.03)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    build.build_tokenizer(args.out, args.seed, data.corpus(args.seed + 1, 4000, args.variety))
    build.write_config(args.out)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.out))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    encoded = []
    while len(encoded) < args.samples:
        item = encode(
            tokenizer,
            data.make_sample(rng, long_ratio=args.long_ratio, variety=args.variety),
            eos,
            args.max_len,
        )
        if item is not None:
            encoded.append(item)
    total = sum(len(s) for s, _ in encoded)
    print(
        f"data: {len(encoded)} samples, {total} tokens, longest {max(len(s) for s, _ in encoded)} "
        f"({time.monotonic() - started:.0f} s)",
        flush=True,
    )

    config = json.loads((args.out / "config.json").read_text())
    model = TinyQwen3(config)
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
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
        ),
    )
    # --compile: float32 compiled by Inductor; on a CPU about twice as fast as bf16
    # autocast in eager mode (small matrices, many elementwise ops to fuse).
    step_model = torch.compile(model, dynamic=True) if args.compile else model
    stream = batches(encoded, args.tokens_per_batch, rng)
    seen, loss_avg, t0 = 0, None, time.monotonic()
    for step in range(1, args.steps + 1):
        ids, targets, weights = collate(encoded, next(stream), args.prompt_weight)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.compile):
            logits = step_model(ids)
        per_token = F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets.view(-1), reduction="none"
        )
        loss = (per_token * weights.view(-1)).sum() / weights.sum()
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
                f"{seen / elapsed:.0f} tok/s, {elapsed / 60:.1f} min",
                flush=True,
            )

    from safetensors.torch import save_file

    save_file(model.mlx_state(), str(args.out / "model.safetensors"), metadata={"format": "mlx"})
    size = (args.out / "model.safetensors").stat().st_size
    print(
        f"wrote {args.out} ({size / 1e6:.1f} MB weights) in {(time.monotonic() - started) / 60:.1f} min",
        flush=True,
    )


if __name__ == "__main__":
    main()
