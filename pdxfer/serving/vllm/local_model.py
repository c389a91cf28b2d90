"""A small Llama in a Hugging Face folder, built here: the tests, benchmarks and demos never
download a model.

``build_model(path, ...)`` writes the config, seeded weights, a byte-level BPE tokenizer
trained on the text below (with a chat template) and a generation config. The same arguments
give the same bytes, so a prefill and a decode that each build the folder run the same model
(``fingerprint`` names those bytes); vLLM loads it with ``HF_HUB_OFFLINE=1``. ``SHAPES``:
``small`` (4 layers, GQA: fast engines for the tests) and ``kv32k`` (32 KiB of KV per token in
bf16, 64 KiB served in float32, so moving KV is a real share of a request's time).

    python -m pdxfer.serving.vllm.local_model /tmp/llama-small [--shape small] [--layers 4 ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ...setting import setting, settings_of

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS, EOS = 0, 1

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The tokenizer's training text (shipped with the code, so every machine trains the same
# vocabulary). Any text works: byte-level BPE encodes every string; these merges only make
# English-like prompts a little shorter.
CORPUS = """\
The prefill side of a disaggregated server computes the key and value cache of a prompt and
sends it to the decode side, which then generates the answer one token at a time. Moving
that cache quickly, and only the part the decode does not already hold, is what decides the
time to the first token. A decode that served a conversation before keeps its history in
host memory or on a local disk, restores it while the network brings the rest, and asks the
prefill only for the new question. Every wait has a deadline, every page that could still be
written is held until no write can land, and every byte that arrives is checked before the
engine trusts it. When a peer dies, the request ends with a clear error or is computed again,
and the next request finds a healthy pair.
Once upon a time a small river ran past a quiet village. The children of the village would
sit on its bank in the evening and count the boats that went by: red ones, blue ones, a
green one with a white sail. The old miller told them that the river remembered every boat,
and that if they listened carefully they could hear it whisper their names. Nobody believed
him, but everybody listened.
In the morning the market opened early. Bakers brought bread, farmers brought apples and
cheese, and a traveller from the north sold maps of places nobody had seen. Numbers were
shouted, coins were counted: one, two, three, four, five, six, seven, eight, nine, ten,
eleven, twelve, twenty, thirty, forty, fifty, one hundred, one thousand.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i * 2))
Questions and answers: What is a cache? A place that keeps what was computed so that it
need not be computed again. Why does the decode need the prompt's cache? Because attention
looks back at every earlier token. How large is it? A few kilobytes to a megabyte per token,
depending on the model: layers times heads times the head size times two.
"""


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 64
    intermediate: int = 512
    vocab: int = 1024
    max_len: int = 4096

    def __post_init__(self) -> None:
        if self.head_size not in (64, 128):
            raise ValueError(f"head size must be 64 or 128, got {self.head_size}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must be a multiple of kv heads {self.kv_heads}")
        if self.vocab <= len(SPECIALS) + 256:
            raise ValueError(f"vocab {self.vocab} must exceed the byte alphabet and specials")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_size * 2  # K and V, bf16


SHAPES = {
    "small": Shape(),
    "kv32k": Shape(layers=8, hidden=256, heads=8, kv_heads=8, head_size=128, intermediate=512),
    # benchmarks/goodput.py: large enough that the forward, not Python, sets a step's time
    "goodput": Shape(
        layers=4, hidden=768, heads=12, kv_heads=4, head_size=64, intermediate=2048, max_len=9216
    ),
}


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """``python -m pdxfer.serving.vllm.local_model``'s options (its flags are generated from these
    fields); ``build_model`` defaults to the same shape and seed."""

    shape: str = setting("small", "the shape to start from", choices=tuple(sorted(SHAPES)))
    seed: int = setting(0, "weight seed (the same seed, the same bytes)")
    layers: int | None = setting(None, "override the shape's decoder layers")
    hidden: int | None = setting(None, "override the shape's hidden size")
    heads: int | None = setting(None, "override the shape's attention heads")
    kv_heads: int | None = setting(None, "override the shape's KV heads")
    head_size: int | None = setting(None, "override the shape's head size")
    intermediate: int | None = setting(None, "override the shape's MLP size")
    vocab: int | None = setting(None, "override the shape's vocabulary size")


_BUILD = {n: s.default for n, s in settings_of(BuildOptions).items()}
_OVERRIDES = tuple(n for n in _BUILD if n not in ("shape", "seed"))


def _tokenizer_json(vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok.to_str()


def _weights(s: Shape, seed: int) -> dict[str, object]:
    """Seeded weights scaled so activations stay O(1) and greedy logits have clear margins
    (near-ties would make bf16 rounding decide tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    h, hd = s.hidden, s.head_size
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w(s.vocab, h, std=1.0)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = w(s.heads * hd, h, std=h**-0.5)
        out[p + "self_attn.k_proj.weight"] = w(s.kv_heads * hd, h, std=h**-0.5)
        out[p + "self_attn.v_proj.weight"] = w(s.kv_heads * hd, h, std=h**-0.5)
        out[p + "self_attn.o_proj.weight"] = w(h, s.heads * hd, std=(s.heads * hd) ** -0.5)
        out[p + "mlp.gate_proj.weight"] = w(s.intermediate, h, std=h**-0.5)
        out[p + "mlp.up_proj.weight"] = w(s.intermediate, h, std=h**-0.5)
        out[p + "mlp.down_proj.weight"] = w(h, s.intermediate, std=s.intermediate**-0.5)
        out[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    out["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    out["lm_head.weight"] = w(s.vocab, h, std=4 * h**-0.5)
    return out


def _config(s: Shape) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_size,
        "vocab_size": s.vocab,
        "max_position_embeddings": s.max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS,
        "eos_token_id": EOS,
    }


def write_tokenizer(root: Path, vocab: int, max_len: int) -> None:
    """The tokenizer files every model built here shares (a byte-level BPE on ``CORPUS``)."""
    (root / "tokenizer.json").write_text(_tokenizer_json(vocab))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIALS[BOS],
                "eos_token": SPECIALS[EOS],
                "pad_token": SPECIALS[EOS],
                "add_bos_token": False,
                "model_max_length": max_len,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
            sort_keys=True,
        )
    )
    (root / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": SPECIALS[BOS], "eos_token": SPECIALS[EOS], "pad_token": SPECIALS[EOS]},
            indent=1,
            sort_keys=True,
        )
    )
    (root / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}, indent=1, sort_keys=True)
    )


def build_model(
    path: str | os.PathLike[str],
    shape: Shape | str = _BUILD["shape"],
    seed: int = _BUILD["seed"],
    name: str = "pdxfer-llama",
) -> Path:
    """Write the model folder (idempotent: an existing folder built with the same arguments
    is kept as it is). Returns the folder."""
    from safetensors.torch import save_file

    s = SHAPES[shape] if isinstance(shape, str) else shape
    root = Path(path)
    stamp = json.dumps({"shape": asdict(s), "seed": seed, "name": name}, sort_keys=True)
    if (root / "pdxfer_build.json").is_file() and (root / "pdxfer_build.json").read_text() == stamp:
        return root
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(_config(s), indent=1, sort_keys=True))
    save_file(_weights(s, seed), str(root / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(root, s.vocab, s.max_len)
    (root / "pdxfer_build.json").write_text(stamp)  # last: a torn build is rebuilt
    return root


def fingerprint(path: str | os.PathLike[str]) -> str:
    """A short digest of the folder's files (what a served model's revision names)."""
    h = hashlib.sha256()
    root = Path(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        h.update(name.encode())
        h.update((root / name).read_bytes())
    return h.hexdigest()[:16]


def parser() -> argparse.ArgumentParser:
    """``python -m pdxfer.serving.vllm.local_model``'s options: the folder, then ``BuildOptions``."""
    from ..cli_args import add_field_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="the folder to write the model to")
    add_field_args(ap, BuildOptions, *_BUILD)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    s = replace(
        SHAPES[a.shape], **{f: getattr(a, f) for f in _OVERRIDES if getattr(a, f) is not None}
    )
    root = build_model(a.path, s, a.seed)
    print(f"{root} ({s.kv_bytes_per_token} bytes of KV per token, {fingerprint(root)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
