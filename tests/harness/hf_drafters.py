"""Tiny speculative drafters for a model built by ``pdxfer.demo.hf_model``, made here from the
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
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_eagle(target: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Write the EAGLE head replaying ``target`` to ``path`` (kept when already built from the
    same target)."""
    import torch
    from safetensors.torch import load_file, save_file

    src, root = Path(target), Path(path)
    stamp = (src / "pdxfer_build.json").read_text() + "|eagle-replay"
    if (root / "pdxfer_build.json").is_file() and (root / "pdxfer_build.json").read_text() == stamp:
        return root
    root.mkdir(parents=True, exist_ok=True)
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
    save_file(out, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(
        json.dumps({**cfg, "num_hidden_layers": layers + 1}, indent=1, sort_keys=True)
    )
    for f in TOKENIZER_FILES:
        shutil.copy(src / f, root / f)
    (root / "pdxfer_build.json").write_text(stamp)
    return root
