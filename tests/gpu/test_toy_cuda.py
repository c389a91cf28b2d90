"""The toy model on a GPU (``--torch-device cuda:0``): collected everywhere, run where
``torch.cuda`` sees a device (``gpu_check.sh``'s ``pytest_gpu`` step).

The serving tests prove on the CPU that a toy's output does not depend on how its prompt is
chunked or who wrote its pages; on a device the same must hold, with the weights, the pools
and every op of the forward there, or a PD pair on a GPU could not equal its colocated
reference.
"""

from __future__ import annotations

import pytest
import torch

from pdxfer.serving.toy.model import ToyConfig, ToyModel, make_draft

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"
)
PROMPT = [(7 * i + 3) % 256 for i in range(150)]


def test_a_toy_on_a_gpu_computes_there_and_its_tokens_do_not_depend_on_chunks() -> None:
    cfg = ToyConfig(max_seq_len=256)
    m = ToyModel(cfg, device="cuda:0")
    assert m.weights_digest() == ToyModel(cfg).weights_digest()  # the same weights anywhere
    assert all(t.device.type == "cuda" for _, t in m.named_weights())
    assert all(t.device.type == "cuda" for t in m.new_kv_pool(4).tensors)  # by default
    assert m.generate(PROMPT, 12, chunk_size=7) == m.generate(PROMPT, 12)


def test_layer_hooks_see_each_layer_written_in_device_pages() -> None:
    """What a prefill sends at ``on_layer(li)`` is that layer's KV of the chunk, complete."""
    m = ToyModel(ToyConfig(max_seq_len=256), device="cuda:0")
    d = make_draft(m)
    kv = m.new_kv_pool(16)
    pages = kv.allocator.alloc(m.pages_for(len(PROMPT)))
    seen: dict[int, torch.Tensor] = {}

    def on_layer(li: int, a: int, b: int) -> None:
        k, _ = kv.layer(li)
        seen[li] = k[pages].cpu().clone()

    m.prefill(PROMPT, pages, kv, chunk_size=len(PROMPT), on_layer=on_layer)
    for li in range(m.config.n_layers):
        k, _ = kv.layer(li)
        assert torch.equal(seen[li], k[pages].cpu()) and seen[li].abs().sum() > 0
    # the draft (its bottom layers, shared weights) computes on the same device
    dkv = d.new_kv_pool(16, allocator=kv.allocator)
    d.forward(PROMPT, 0, pages, dkv, logits_for="none")
    assert torch.equal(dkv.tensors[0][pages].cpu(), kv.tensors[0][pages].cpu())
