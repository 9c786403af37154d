"""Build tiny random-weight VLM checkpoints offline (nothing downloaded).

    python tools/build_tiny_vlm.py OUT_DIR [--seed 0] [--dtype float32|bfloat16]

Writes OUT_DIR/qwen2_5_vl, OUT_DIR/qwen3_vl, OUT_DIR/gemma3 and OUT_DIR/mllama:
each a checkpoint that mlx_vlm.load() reads (model + processor), and the first
three also mlx_lm.load() (text part; mlx-lm has no mllama). Tokenizer:
mlxtrio's tiny-chat BPE (4096 ids) plus the family's image tokens. Weights:
mlx-vlm's own module init under a fixed seed (deterministic), saved under
mlx-vlm's parameter names (a superset of mlx-lm's, so both loaders accept the
file). Needs mlx-vlm importable (``pip install 'mlxtrio[vision]'``).

Serve one with ``mlxtrio serve --model OUT_DIR/qwen2_5_vl``: the tests do.
Qwen needs untied output weights: tied, a tiny random stack echoes its input;
mllama's gates start at 0 (tanh(0) = 0 would hide the image): they are set
to 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Tokenizer

TINY_CHAT = Path(__file__).resolve().parent.parent / "mlxtrio" / "assets" / "tiny-chat"
VOCAB = 4160  # 4096 BPE ids + room for the image tokens, a multiple of 64
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Chat templates: tiny-chat's ChatML turns; list content may hold image parts.
# '@IMAGE@' below is replaced by the family's per-image placeholder text.
TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content is string -%}{{- message.content -}}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' or part.type == 'image_url' or 'image' in part -%}{{- '@IMAGE@' -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def write_tokenizer(out: Path, extra: list[str], extra_config: dict) -> dict[str, int]:
    tok = Tokenizer.from_file(str(TINY_CHAT / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in extra}
    cfg = json.loads((TINY_CHAT / "tokenizer_config.json").read_text())
    cfg.pop("added_tokens_decoder", None)
    cfg["additional_special_tokens"] = list(cfg.get("additional_special_tokens", [])) + extra
    cfg.update(extra_config)
    cfg.pop("chat_template", None)  # written as chat_template.jinja
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copy(TINY_CHAT / "special_tokens_map.json", out / "special_tokens_map.json")
    return ids


def save(
    out: Path,
    config: dict,
    dtype: str,
    seed: int,
    drop: tuple[str, ...] = (),
    ones: tuple[str, ...] = (),
) -> None:
    """mlx-vlm's init of ``config``'s architecture under ``seed``, without the
    weights named in ``drop``, and those whose names end with one of ``ones``
    set to 1."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    mx.random.seed(seed)
    arch, _ = get_model_and_args(config)
    # As mlx_vlm.utils.load_model does: from_dict may fill text_config in place.
    raw = json.loads(json.dumps(config))
    raw.setdefault("text_config", {})
    raw.setdefault("vision_config", {})
    cfg = arch.ModelConfig.from_dict(raw)
    cfg = update_module_configs(cfg, arch, raw, ["text", "vision"])
    model = arch.Model(cfg)
    flat = dict(tree_flatten(model.parameters()))
    flat = (
        {k: mx.ones_like(v) if k.endswith(ones) else v for k, v in flat.items()} if ones else flat
    )
    flat = {k: v.astype(getattr(mx, dtype)) for k, v in flat.items() if k not in drop}
    mx.save_safetensors(str(out / "model.safetensors"), flat, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config["eos_token_id"]})
    )


def write_preprocessor(out: Path, mean: list[float], std: list[float], **fields: object) -> None:
    """The image processor's config: ``fields`` and the usual RGB rescale and
    normalization by ``mean`` and ``std``."""
    pre = {
        **fields,
        "image_mean": mean,
        "image_std": std,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))


def start_qwen(out: Path) -> dict[str, int]:
    """A Qwen-VL checkpoint's directory, tokenizer and chat template; the
    vision tokens' ids."""
    out.mkdir(parents=True, exist_ok=True)
    toks = [
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ]
    ids = write_tokenizer(out, toks, {})
    (out / "chat_template.jinja").write_text(
        TEMPLATE.replace("@IMAGE@", "<|vision_start|><|image_pad|><|vision_end|>")
    )
    return ids


def build_qwen2_5_vl(
    out: Path,
    dtype: str,
    seed: int,
    text: dict | None = None,
    vision: dict | None = None,
    max_pixels: int = 28 * 28 * 64,
) -> None:
    """``text`` / ``vision``: config fields over the tiny sizes (the
    benchmarks build a bench-sized one); ``max_pixels``: the processor's
    budget (at most max_pixels / 784 image tokens per image)."""
    ids = start_qwen(out)
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        # The text model's fields live at the root (the HF Qwen2.5-VL layout).
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # head_dim 16
        "tie_word_embeddings": False,  # tied, a tiny random stack echoes its input
        "torch_dtype": dtype,
        "eos_token_id": [2, 0],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "in_channels": 3,
            "tokens_per_second": 2,
            **(vision or {}),
        },
    }
    config.update(text or {})
    save(out, config, dtype, seed)
    write_preprocessor(
        out,
        CLIP_MEAN,
        CLIP_STD,
        image_processor_type="Qwen2VLImageProcessor",
        processor_class="Qwen2_5_VLProcessor",
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=56 * 56,
        max_pixels=max_pixels,
    )


def build_qwen3_vl(out: Path, dtype: str, seed: int) -> None:
    ids = start_qwen(out)
    config = {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "torch_dtype": dtype,
        "eos_token_id": [2, 0],
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "text_config": {
            "model_type": "qwen3_vl_text",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "vocab_size": VOCAB,
            "max_position_embeddings": 32768,
            "rope_theta": 5000000.0,
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "qwen3_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "num_position_embeddings": 64,  # an 8 x 8 grid of learned positions
            "deepstack_visual_indexes": [0],
            "hidden_act": "gelu_pytorch_tanh",
        },
    }
    save(out, config, dtype, seed)
    write_preprocessor(
        out,
        [0.5, 0.5, 0.5],
        [0.5, 0.5, 0.5],
        image_processor_type="Qwen2VLImageProcessorFast",
        processor_class="Qwen3VLProcessor",
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 64},
    )


def build_gemma3(out: Path, dtype: str, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    toks = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    ids = write_tokenizer(
        out,
        toks,
        # transformers 5: named extra special tokens become tokenizer.boi_token,
        # tokenizer.image_token_id, ... which Gemma3Processor reads.
        {
            "extra_special_tokens": {
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            }
        },
    )
    (out / "chat_template.jinja").write_text(TEMPLATE.replace("@IMAGE@", "<start_of_image>"))
    mm_tokens = 4  # (image_size / patch_size / kernel)^2 = (56/14/2)^2
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "torch_dtype": dtype,
        "eos_token_id": [2, 0],
        "pad_token_id": 0,
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "mm_tokens_per_image": mm_tokens,
        "hidden_size": 64,
        "vocab_size": VOCAB,  # mlx-lm's gemma3 reads the root value
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "rms_norm_eps": 1e-6,
            "vocab_size": VOCAB,
            "sliding_window": 16,
            "sliding_window_pattern": 2,  # layer 0 sliding, layer 1 global
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "max_position_embeddings": 32768,
            "mm_tokens_per_image": mm_tokens,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 56,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
        },
    }
    # Gemma 3 ties its output layer to the embeddings: no lm_head in the file.
    save(out, config, dtype, seed, drop=("language_model.lm_head.weight",))
    write_preprocessor(
        out,
        [0.5, 0.5, 0.5],
        [0.5, 0.5, 0.5],
        image_processor_type="Gemma3ImageProcessor",
        processor_class="Gemma3Processor",
        size={"height": 56, "width": 56},
        do_resize=True,
        resample=2,
        do_pan_and_scan=False,
    )
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": mm_tokens}, indent=2)
    )


def build_mllama(out: Path, dtype: str, seed: int) -> None:
    """Llama 3.2 Vision's architecture: the language model attends to the
    image features through cross-attention layers (1 and 3 of 4); one image
    token per image stays in the prompt."""
    out.mkdir(parents=True, exist_ok=True)
    # MllamaProcessor prepends the tokenizer's bos token (None would be the text "None").
    ids = write_tokenizer(
        out,
        ["<|image|>", "<|begin_of_text|>", "<|python_tag|>"],
        {"bos_token": "<|begin_of_text|>"},
    )
    (out / "chat_template.jinja").write_text(TEMPLATE.replace("@IMAGE@", "<|image|>"))
    tile, tiles, vision_hidden, intermediate = 28, 4, 32, [0, 1]
    config = {
        "architectures": ["MllamaForConditionalGeneration"],
        "model_type": "mllama",
        "torch_dtype": dtype,
        "eos_token_id": [2, 0],
        "image_token_index": ids["<|image|>"],
        "vocab_size": VOCAB,
        "text_config": {
            "model_type": "mllama_text_model",
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "cross_attention_layers": [1, 3],
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": None,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "bos_token_id": ids["<|begin_of_text|>"],
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
        "vision_config": {
            "model_type": "mllama_vision_model",
            # (28 / 14)^2 + 1 = 5 tokens a tile: not a multiple of 8, which
            # mlx-vlm's vision attention mask needs (it pads to one).
            "image_size": tile,
            "patch_size": 14,
            "num_channels": 3,
            "hidden_size": vision_hidden,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_global_layers": 1,
            "num_attention_heads": 2,
            "max_num_tiles": tiles,
            # No max_aspect_ratio_id: a read-only property of transformers'
            # MllamaVisionConfig, which AutoTokenizer parses from this file.
            "norm_eps": 1e-5,
            "intermediate_layers_indices": intermediate,
            "vision_output_dim": vision_hidden * (1 + len(intermediate)),
            "supported_aspect_ratios": [
                [1, 1],
                [1, 2],
                [1, 3],
                [1, 4],
                [2, 1],
                [2, 2],
                [3, 1],
                [4, 1],
            ],
        },
    }
    save(out, config, dtype, seed, ones=("gate", "gate_attn", "gate_ffn"))
    write_preprocessor(
        out,
        CLIP_MEAN,
        CLIP_STD,
        image_processor_type="MllamaImageProcessor",
        processor_class="MllamaProcessor",
        do_resize=True,
        do_pad=True,
        size={"height": tile, "width": tile},
        max_image_tiles=tiles,
        resample=2,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    out = Path(a.out)
    build_qwen2_5_vl(out / "qwen2_5_vl", a.dtype, a.seed)
    build_gemma3(out / "gemma3", a.dtype, a.seed + 1)
    build_qwen3_vl(out / "qwen3_vl", a.dtype, a.seed + 2)
    build_mllama(out / "mllama", a.dtype, a.seed + 3)


if __name__ == "__main__":
    main()
