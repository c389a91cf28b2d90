"""Tiny random models of the families people serve with PD, built here with ``transformers``
(never downloaded): MLA (DeepSeek-V2), sliding window (Mistral-style, every layer; Gemma 3
and gpt-oss, sliding beside full), and attention beside Mamba2 (Nemotron-H) or Gated
DeltaNet (Qwen3-Next). Each shares ``hf_model``'s tokenizer.

Weights come from ``transformers``' own initialisation under a fixed seed, wider than its
default so outputs depend on the whole context; the output head is scaled up so greedy
logits have clear margins (a near-tie flips with the batch's shape).

    python -m tests.harness.hf_families /tmp/models [FAMILY ...]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdxfer.serving.vllm.local_model import BOS, EOS, write_tokenizer

VOCAB = 1024
MAX_LEN = 8192
WINDOW = 128
"""The sliding window of every sliding family: prompts in the tests run past it."""
CHUNK = 64
"""The attention chunk of every chunked-local family (two of the tests' 32-token blocks):
prompts in the tests span many chunks."""


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    config_class: str
    architecture: str
    dtype: str
    """What vLLM serves it in: vLLM's CPU MoE, MLA, GDN and Mamba kernels want bf16."""
    config: dict[str, Any] = field(default_factory=dict)
    vllm_args: tuple[str, ...] = ()
    """Arguments colocated vLLM needs for it here (and so every side of a pair)."""
    window: int = 0
    """Its sliding window (0: none)."""
    chunk: int = 0
    """Its local attention chunk (0: none)."""
    exact_args: tuple[str, ...] = ()
    """bf16 families, whose CPU kernels round differently per step shape: chunks of one
    32-token block (the tests' block size), so that a prompt's first k blocks are computed
    in the same chunks whether colocated vLLM serves them alone or a prefill serves them
    with one token more (``test_vllm_families``, ``Pair.case``); vLLM ignores it where it
    does not chunk (MLA on a CPU without AMX)."""


_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": MAX_LEN,
    "tie_word_embeddings": False,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": EOS,
    "initializer_range": 0.1,
}

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "mistral_swa",
            "MistralConfig",
            "MistralForCausalLM",
            "float32",
            {**_COMMON, "num_hidden_layers": 4, "intermediate_size": 512, "sliding_window": WINDOW},
            window=WINDOW,
        ),
        Family(
            "gemma3",
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            "float32",
            {
                **_COMMON,
                "num_hidden_layers": 6,
                "intermediate_size": 512,
                "sliding_window": WINDOW,
                "query_pre_attn_scalar": 64,
                "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            },
            window=WINDOW,
        ),
        Family(
            "gpt_oss",
            "GptOssConfig",
            "GptOssForCausalLM",
            "bfloat16",
            {
                **_COMMON,
                "num_hidden_layers": 4,
                "intermediate_size": 256,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
            window=WINDOW,
            exact_args=("--max-num-batched-tokens", "32", "--max-num-seqs", "32"),
        ),
        Family(
            "deepseek_v2",
            "DeepseekV2Config",
            "DeepseekV2ForCausalLM",
            "bfloat16",
            {
                **_COMMON,
                "num_hidden_layers": 2,
                "intermediate_size": 512,
                "num_key_value_heads": 4,
                "kv_lora_rank": 512,
                "q_lora_rank": None,
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 64,
                "v_head_dim": 64,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_shared_experts": 1,
                "moe_intermediate_size": 128,
                "first_k_dense_replace": 2,
                "topk_method": "greedy",
                "n_group": 1,
                "topk_group": 1,
            },
            exact_args=("--max-num-batched-tokens", "32", "--max-num-seqs", "32"),
        ),
        Family(
            "qwen3_next",
            "Qwen3NextConfig",
            "Qwen3NextForCausalLM",
            "bfloat16",
            {
                **_COMMON,
                "num_hidden_layers": 4,
                "intermediate_size": 512,
                "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 128,
                "shared_expert_intermediate_size": 128,
            },
            # prefix caching sets its block size (544 on, 4096 off): the same on every side
            vllm_args=("--no-enable-prefix-caching",),
            exact_args=("--max-num-batched-tokens", "32", "--max-num-seqs", "32"),
        ),
        Family(
            "nemotron_h",
            "NemotronHConfig",
            "NemotronHForCausalLM",
            "float32",
            {
                **_COMMON,
                "layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"],
                "intermediate_size": 512,
                "mamba_num_heads": 8,
                "mamba_head_dim": 64,
                "n_groups": 1,
                "ssm_state_size": 64,
                "chunk_size": 128,
                "expand": 2,
            },
            # vLLM's CPU Mamba2 path fails with prefix caching on
            vllm_args=("--no-enable-prefix-caching",),
        ),
        Family(
            "llama4",
            "Llama4TextConfig",
            "Llama4ForCausalLM",
            "float32",
            {
                **_COMMON,
                "num_hidden_layers": 4,
                "intermediate_size": 256,
                "intermediate_size_mlp": 512,
                "num_local_experts": 4,
                "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 2,
                "no_rope_layer_interval": 2,
                "attention_chunk_size": CHUNK,
            },
            chunk=CHUNK,
        ),
    )
}

LOGIT_SCALE = 4.0
"""How much the output head is scaled over its initialisation (std 0.1: every later token
depends on the context, not one token repeated, so misplaced KV changes the answer)."""


def build_family(path: str | os.PathLike[str], family: str, seed: int = 0) -> Path:
    """Write ``family``'s model folder (kept when already built with the same arguments)."""
    import torch
    import transformers

    f = FAMILIES[family]
    root = Path(path)
    stamp = json.dumps(
        {"family": family, "seed": seed, "config": f.config, "scale": LOGIT_SCALE},
        sort_keys=True,
        default=str,
    )
    if (root / "pdxfer_build.json").is_file() and (root / "pdxfer_build.json").read_text() == stamp:
        return root
    root.mkdir(parents=True, exist_ok=True)
    cfg = getattr(transformers, f.config_class)(**f.config)
    cfg.architectures = [f.architecture]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight.mul_(LOGIT_SCALE)
    model.to(torch.bfloat16).save_pretrained(root, safe_serialization=True)
    write_tokenizer(root, VOCAB, MAX_LEN)
    (root / "pdxfer_build.json").write_text(stamp)  # last: a torn build is rebuilt
    return root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="the folder each family's model is written under")
    ap.add_argument(
        "families",
        nargs="*",
        default=sorted(FAMILIES),
        help=f"which to build (default: all of {', '.join(sorted(FAMILIES))})",
    )
    a = ap.parse_args(argv)
    for name in a.families:
        print(build_family(Path(a.path) / name, name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
