"""A tiny vision-language model (Idefics3: a SigLIP-style vision tower, a pixel-shuffle
projector, a Llama) built here with ``transformers``, never downloaded, for images through the
router. (vLLM 0.32's LLaVA and Qwen2-VL need ``torchvision``, which its CPU build lacks.)

The folder holds the config, seeded weights (wider than ``transformers``' default and the
output head scaled up, as in ``hf_families``, so the answer depends on the image and the
text), ``hf_model``'s tokenizer plus Idefics3's image tokens, an image processor (one tile per
image: no splitting) and an ``Idefics3Processor`` saved with ``save_pretrained``, and a chat template that puts one
``<image>`` per image part (vLLM expands it to the image's feature tokens).

    python -m tests.harness.hf_vlm /tmp/vlm-tiny
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from pdxfer.serving.vllm.local_model import BOS, EOS, write_tokenizer

from .hf_families import LOGIT_SCALE, VOCAB

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 112
PATCH = 14
SCALE = 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2
"""Feature tokens per image (the pixel shuffle folds ``SCALE``² patches into one)."""
SPECIAL = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
MAX_LEN = 4096

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% else %}" + IMAGE_TOKEN + "{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""``hf_model``'s template, with content parts: text as it is, an image as ``<image>``."""

_TEXT = {
    "vocab_size": VOCAB + len(SPECIAL),
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": MAX_LEN,
    "tie_word_embeddings": False,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": EOS,
    "initializer_range": 0.1,
    "rms_norm_eps": 1e-5,
}
_VISION = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH,
    "initializer_range": 0.1,
}


def build_vlm(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write the model folder (kept when already built with the same arguments)."""
    import torch
    import transformers as tf

    root = Path(path)
    stamp = json.dumps(
        {
            "vlm": "idefics3",
            "seed": seed,
            "text": _TEXT,
            "vision": _VISION,
            "scale": LOGIT_SCALE,
            "template": CHAT_TEMPLATE,
        },
        sort_keys=True,
    )
    if (root / "pdxfer_build.json").is_file() and (root / "pdxfer_build.json").read_text() == stamp:
        return root
    root.mkdir(parents=True, exist_ok=True)
    write_tokenizer(root, VOCAB, MAX_LEN)
    tok = tf.PreTrainedTokenizerFast.from_pretrained(root)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    if len(tok) > _TEXT["vocab_size"]:
        raise RuntimeError(f"{len(tok)} tokens, past the model's vocabulary")
    tok.chat_template = CHAT_TEMPLATE
    cfg = tf.Idefics3Config(
        vision_config=tf.Idefics3VisionConfig(**_VISION),
        text_config=tf.LlamaConfig(**_TEXT),
        image_token_id=image_id,
        scale_factor=SCALE,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = tf.Idefics3ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    model.save_pretrained(root, safe_serialization=True)
    edge = {"longest_edge": IMAGE_SIZE}
    image_proc = tf.Idefics3ImageProcessor(do_image_splitting=False, size=edge, max_image_size=edge)
    proc = tf.Idefics3Processor(
        image_processor=image_proc,
        tokenizer=tok,
        image_seq_len=IMAGE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    proc.save_pretrained(root)
    (root / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}, indent=1, sort_keys=True)
    )
    (root / "pdxfer_build.json").write_text(stamp)  # last: a torn build is rebuilt
    return root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="the folder to write the model to")
    ap.add_argument(
        "--seed", type=int, default=0, help="weight seed (the same seed, the same bytes)"
    )
    a = ap.parse_args(argv)
    print(build_vlm(a.path, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
