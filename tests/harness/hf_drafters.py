"""Tiny speculative drafters for a model built by ``pdxfer.serving.vllm.local_model``, made here from the
target's own weights (never downloaded), so that the acceptance they get says something.

``build_eagle(target, path)``: an EAGLE head (vLLM's ``method: eagle``, ``EagleLlamaForCausalLM``)
that replays the target. vLLM's EAGLE layer 0 has no input norm, so layer 0 here is a pass
(its attention output and MLP are zero: the residual stream leaves it as the embedding), and
layers 1.. are the target's layers. ``fc`` takes the embedding half of its input and drops
the target's hidden state. At position ``i`` the head reads token ``i + 1``, so it runs the
target shifted by one position; rotary attention depends on relative positions only, so
its drafts are the target's next tokens (up to rounding), acceptance near 1. Its attention
reads its own KV of the whole prompt: a decode whose drafter lacked the prompt's draft KV
would draft other tokens. The head shares the target's embedding and output head (vLLM
shares them when the checkpoint has none).

``build_eagle3(target, path)``: an EAGLE3 head (``method: eagle3``, ``Eagle3LlamaForCausalLM``)
with seeded random weights, reading the target's hidden states after layers 1, 2 and 3. Its
layer 0 sees the next token's embedding only through attention (beside the target's hidden
states), so no weights make it replay the target simply: its drafts are right only by
chance, but they are a function of its own KV of the prompt all the same.

``build_mtp(target, path)``: ``target`` as a MiMo model (``method: mtp``) with a seeded random
MTP layer (``build_mtp`` says how).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _stamp(src: Path, root: Path, tag: str) -> str | None:
    """The build stamp of ``tag`` from ``src`` for ``root``; None when ``root`` already holds
    that build (built again only when the target or the recipe changed)."""
    stamp = (src / "pdxfer_build.json").read_text() + "|" + tag
    mark = root / "pdxfer_build.json"
    if mark.is_file() and mark.read_text() == stamp:
        return None
    root.mkdir(parents=True, exist_ok=True)
    return stamp


def _write(
    src: Path,
    root: Path,
    weights: dict[str, Any],
    cfg: dict[str, Any],
    stamp: str,
    optional: tuple[str, ...] = (),
) -> Path:
    """Write a built model: its weights, config, the target's tokenizer (and each of
    ``optional`` the target has), then the stamp, last, so a build cut short is redone."""
    from safetensors.torch import save_file

    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    for f in (*TOKENIZER_FILES, *optional):
        if f in TOKENIZER_FILES or (src / f).is_file():
            shutil.copy(src / f, root / f)
    (root / "pdxfer_build.json").write_text(stamp)
    return root


def _seeded(dtype: Any) -> Callable[[int, int], Any]:
    """``w(rows, cols)``: seeded random weights of ``dtype`` (seed 0, scaled by the fan-in),
    drawn in call order."""
    import torch

    g = torch.Generator().manual_seed(0)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * cols**-0.5).to(dtype)

    return w


def _decoder_layer(
    cfg: dict[str, Any], w: Callable[[int, int], Any], p: str, inp: int
) -> dict[str, Any]:
    """Random weights of one Llama/Qwen2 decoder layer's projections under prefix ``p``, its
    attention reading ``inp`` features."""
    h, hd = int(cfg["hidden_size"]), int(cfg["head_dim"])
    heads, kv, mlp = (
        int(cfg[k]) for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    )
    return {
        p + "self_attn.q_proj.weight": w(heads * hd, inp),
        p + "self_attn.k_proj.weight": w(kv * hd, inp),
        p + "self_attn.v_proj.weight": w(kv * hd, inp),
        p + "self_attn.o_proj.weight": w(h, heads * hd),
        p + "mlp.gate_proj.weight": w(mlp, h),
        p + "mlp.up_proj.weight": w(mlp, h),
        p + "mlp.down_proj.weight": w(h, mlp),
    }


def build_eagle(target: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Write the EAGLE head replaying ``target`` to ``path`` (kept when already built from the
    same target)."""
    import torch
    from safetensors.torch import load_file

    src, root = Path(target), Path(path)
    stamp = _stamp(src, root, "eagle-replay")
    if stamp is None:
        return root
    cfg = json.loads((src / "config.json").read_text())
    layers, h = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    w = load_file(str(src / "model.safetensors"))
    dt = w["model.embed_tokens.weight"].dtype
    out: dict[str, torch.Tensor] = {}
    for name, t in w.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            out[f"layers.{int(i) + 1}.{rest}"] = t
    for name, t in w.items():  # layer 0: the same shapes, a pass
        if name.startswith("model.layers.0.") and "input_layernorm" not in name:
            rest = name[len("model.layers.0.") :]
            zero = ("o_proj" in rest) or ("down_proj" in rest)
            out[f"layers.0.{rest}"] = torch.zeros_like(t) if zero else t.clone()
    out["fc.weight"] = torch.cat(
        [torch.eye(h, dtype=dt), torch.zeros(h, h, dtype=dt)], dim=1
    ).contiguous()
    return _write(src, root, out, {**cfg, "num_hidden_layers": layers + 1}, stamp)


def build_eagle3(target: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Write a seeded random EAGLE3 head for ``target`` to ``path`` (kept when already built
    from the same target)."""
    import torch

    src, root = Path(target), Path(path)
    stamp = _stamp(src, root, "eagle3-random")
    if stamp is None:
        return root
    cfg = json.loads((src / "config.json").read_text())
    h = int(cfg["hidden_size"])
    aux = [1, 2, 3]
    w = _seeded(torch.bfloat16)
    p = "midlayer."
    out = _decoder_layer(cfg, w, p, 2 * h)
    out["fc.weight"] = w(h, len(aux) * h)
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"{p}{n}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    out["norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    cfg = {**cfg, "num_hidden_layers": 1, "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}
    return _write(src, root, out, cfg, stamp)


def build_mtp(target: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Write ``target`` as a MiMo model with one seeded random MTP layer to ``path`` (kept when
    already built from the same target): vLLM's ``method: mtp`` on ``MiMoForCausalLM``, the
    one MTP model of a plain dense decoder (Qwen2's). Qwen2's attention has q/k/v biases:
    zero here, so the main model computes exactly what ``target`` does. The MTP layer reads
    the target's last hidden state and the next token's embedding; random, its drafts are
    right only by chance, but it keeps KV of its own for the prompt (its one decoder layer),
    which the decode's drafter reads."""
    import torch
    from safetensors.torch import load_file

    src, root = Path(target), Path(path)
    stamp = _stamp(src, root, "mimo-mtp-random")
    if stamp is None:
        return root
    cfg = json.loads((src / "config.json").read_text())
    h, hd = int(cfg["hidden_size"]), int(cfg["head_dim"])
    heads, kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    out = load_file(str(src / "model.safetensors"))
    dt = out["model.embed_tokens.weight"].dtype
    w = _seeded(dt)
    p = "model.mtp_layers.0."
    out[p + "input_proj.weight"] = w(h, 2 * h)
    out.update(_decoder_layer(cfg, w, p, h))
    for pre in [f"model.layers.{i}." for i in range(int(cfg["num_hidden_layers"]))] + [p]:
        for x, n in (("q", heads), ("k", kv), ("v", kv)):
            out[f"{pre}self_attn.{x}_proj.bias"] = torch.zeros(n * hd, dtype=dt)
    for n in (
        "token_layernorm",
        "hidden_layernorm",
        "input_layernorm",
        "post_attention_layernorm",
        "final_layernorm",
    ):
        out[f"{p}{n}.weight"] = torch.ones(h, dtype=dt)
    cfg = {
        **cfg,
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "num_nextn_predict_layers": 1,
        "use_sliding_window": False,
    }
    return _write(src, root, out, cfg, stamp, optional=("generation_config.json",))
