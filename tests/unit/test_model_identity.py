"""Two workers must run the same model: the toy model's weights do not depend on its context
length, and a fingerprint difference is named, not just refused."""

from __future__ import annotations

import torch

from pdxfer.endpoint.sender import model_diff
from pdxfer.serving.toy import ToyConfig, ToyModel


def test_weights_do_not_depend_on_max_seq_len() -> None:
    a, b = ToyModel(ToyConfig(max_seq_len=512)), ToyModel(ToyConfig(max_seq_len=1024))
    for (na, ta), (nb, tb) in zip(a.named_weights(), b.named_weights()):
        assert na == nb
        if na == "pos_emb":
            assert torch.equal(ta, tb[:512])
        else:
            assert torch.equal(ta, tb), na


def test_a_fingerprint_difference_is_named() -> None:
    why = model_diff("model=toy seed=1 weights=aa", "model=toy seed=0 weights=bb")
    assert why == "seed: prefill 1, decode 0; weights: prefill aa, decode bb"
    assert "prefill 'x'" in model_diff("x", "y")
