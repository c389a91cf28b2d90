"""The toy model at TP > 1 is bit for bit the TP = 1 model: each rank's tokens, logits and the
KV of its heads equal the TP = 1 run's, so a served TP 2 prefill feeding a TP 1 decode (or the
reverse) can be checked against the one colocated reference.

The ranks run as threads of this process with an in-memory all-gather (a barrier and a list):
the gather is arithmetic-free either way, and the served tests run the same model over gloo
between processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdxfer.serving.toy import ToyConfig, ToyModel, encode, make_draft
from pdxfer.serving.toy.model import SpecDecoder, head_shard

PROMPT = encode("tensor parallel ranks must agree with one rank, bit for bit. " * 4)[:230]
N_NEW = 12


class ThreadGather:
    """All-gather over ``n`` threads: each rank's tensor, concatenated in rank order."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.slots: list[torch.Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n)

    def for_rank(self, r: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def gather(t: torch.Tensor) -> torch.Tensor:
            self.slots[r] = t.clone()
            self.barrier.wait()
            out = torch.cat([s for s in self.slots if s is not None], dim=1)
            self.barrier.wait()  # nobody overwrites a slot before everyone read it
            return out

        return gather


def run_ranks(cfg: ToyConfig, tp: int, job: Callable[[ToyModel], Any]) -> list[Any]:
    g = ThreadGather(tp)
    out: list[Any] = [None] * tp
    errors: list[BaseException] = []

    def one(r: int) -> None:
        try:
            out[r] = job(ToyModel(cfg, tp_rank=r, tp_size=tp, gather=g.for_rank(r)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            g.barrier.abort()

    ts = [threading.Thread(target=one, args=(r,)) for r in range(tp)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors
    return out


def scattered(n: int, total: int) -> list[int]:
    """Page ids in a scrambled order, so placement is part of what is compared."""
    return [(7 * i + 3) % total for i in range(n)]


def generate(m: ToyModel) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Chunked prefill into scattered pages, then greedy steps; tokens, the last logits of
    each step and the pool's tensors."""
    pages = scattered(m.pages_for(len(PROMPT) + N_NEW), 97)
    kv = m.new_kv_pool(97)
    out = [m.prefill(PROMPT, pages, kv, chunk_size=48)]
    logits = []
    while len(out) < N_NEW:
        lg = m.forward([out[-1]], len(PROMPT) + len(out) - 1, pages, kv)[-1]
        logits.append(lg)
        out.append(int(torch.argmax(lg)))
    return out, logits, [t[pages] for t in kv.tensors]


CONFIGS = {"gqa-fp16": ToyConfig(), "mha4-bf16": ToyConfig(n_kv_heads=4, kv_dtype=torch.bfloat16)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_equals_tp1_bit_for_bit(name: str, tp: int) -> None:
    cfg = CONFIGS[name]
    ref_tokens, ref_logits, ref_kv = generate(ToyModel(cfg))
    for r, (tokens, logits, kv) in enumerate(run_ranks(cfg, tp, generate)):
        assert tokens == ref_tokens, (r, tokens, ref_tokens)
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits)), r
        sh = head_shard(cfg, r, tp)
        for mine, full in zip(kv, ref_kv, strict=True):  # this rank's KV heads, as TP 1's
            assert mine.shape[2] == sh.kv_heads
            assert torch.equal(mine, full[:, :, sh.kv_lo : sh.kv_hi]), r


def test_gqa_replication_gives_ranks_sharing_a_kv_head_the_same_kv() -> None:
    cfg = ToyConfig()  # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0; 2, 3 head 1
    assert [head_shard(cfg, r, 4).kv_lo for r in range(4)] == [0, 0, 1, 1]
    kv = [k for _, _, k in run_ranks(cfg, 4, generate)]
    assert all(torch.equal(a, b) for a, b in zip(kv[0], kv[1]))
    assert not all(torch.equal(a, b) for a, b in zip(kv[1], kv[2]))


def test_speculative_decoding_at_tp2_equals_tp1() -> None:
    cfg = ToyConfig()

    def spec(m: ToyModel) -> tuple[list[int], list[int]]:
        d = make_draft(m)
        pages = list(range(m.pages_for(len(PROMPT) + N_NEW + 4)))
        kv = m.new_kv_pool(len(pages))
        dkv = d.new_kv_pool(len(pages), allocator=kv.allocator)
        first = m.prefill(PROMPT, pages, kv, chunk_size=64)
        d.prefill(PROMPT, pages, dkv, chunk_size=64)
        sd = SpecDecoder(m, d, PROMPT, first, kv, dkv, pages, 3)
        while len(sd.seq) - len(PROMPT) < N_NEW:
            sd.step()
        return sd.seq[len(PROMPT) :], sd.accepted

    ref = spec(ToyModel(cfg))
    assert run_ranks(cfg, 2, spec) == [ref, ref]


def test_shards_that_do_not_split_evenly_are_refused() -> None:
    with pytest.raises(ValueError, match="evenly"):
        head_shard(ToyConfig(), 0, 3)
    with pytest.raises(ValueError, match="MLA"):
        head_shard(ToyConfig(attention="mla"), 0, 2)
    with pytest.raises(ValueError, match="gather"):
        ToyModel(ToyConfig(), tp_rank=0, tp_size=2)
