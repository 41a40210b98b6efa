"""Tensor parallelism for TinyCausalLM: the same weights, split across ranks.

Megatron-style: in every block the attention heads are split across ranks
(the qkv projection is column-parallel: each rank computes its own heads;
the output projection is row-parallel: each rank multiplies its heads'
slice and an all_reduce sums the partial outputs), and the MLP likewise
(first linear column-parallel, second row-parallel, one all_reduce). So
every block makes two all_reduce collectives per forward, and every decode
step makes 2 x layers of them: a stalled or partitioned rank stalls or
fails the step on both ranks.

Embeddings, layer norms and the tied output projection are replicated:
every rank computes the same logits, and each rank builds its shard from
the full model drawn from `--seed`, so the TP model is the one-rank model
up to the order of float additions (tests/test_service_ranks.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pyctl.service.model import Block, TinyCausalLM

# Sums a tensor over the ranks, in place, and returns it.
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _rows(t: torch.Tensor, parts: list[slice]) -> torch.Tensor:
    return torch.cat([t[s] for s in parts], dim=0).clone()


class TPBlock(nn.Module):
    """One Block's shard on rank `rank` of `world`."""

    def __init__(self, full: Block, rank: int, world: int, all_reduce: AllReduce) -> None:
        super().__init__()
        d = full.proj.in_features
        heads = full.n_heads
        self.heads, self.head_dim = heads // world, d // heads
        self.all_reduce = all_reduce
        w = self.heads * self.head_dim  # this rank's share of the width
        mine = slice(rank * w, (rank + 1) * w)
        self.ln1, self.ln2 = full.ln1, full.ln2
        # qkv packs [q | k | v] along its output: take this rank's heads of each.
        qkv = [slice(i * d + mine.start, i * d + mine.stop) for i in range(3)]
        self.qkv = nn.Linear(d, 3 * w)
        self.qkv.weight.data = _rows(full.qkv.weight.data, qkv)
        self.qkv.bias.data = _rows(full.qkv.bias.data, qkv)
        # Row-parallel: this rank's input columns; the bias is added once, after the sum.
        self.proj_w = nn.Parameter(full.proj.weight.data[:, mine].clone())
        self.proj_b = nn.Parameter(full.proj.bias.data.clone())
        # Sequential's items are typed Module: these two are Block's Linears.
        fc1, fc2 = cast(nn.Linear, full.mlp[0]), cast(nn.Linear, full.mlp[2])
        hidden = fc1.out_features // world
        hs = slice(rank * hidden, (rank + 1) * hidden)
        self.fc1 = nn.Linear(d, hidden)
        self.fc1.weight.data = fc1.weight.data[hs].clone()
        self.fc1.bias.data = fc1.bias.data[hs].clone()
        self.fc2_w = nn.Parameter(fc2.weight.data[:, hs].clone())
        self.fc2_b = nn.Parameter(fc2.bias.data.clone())

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _d = x.shape
        w = self.heads * self.head_dim
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=-1)
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        part = a.transpose(1, 2).reshape(b, t, w) @ self.proj_w.T
        x = x + self.all_reduce(part.contiguous()) + self.proj_b
        part = F.gelu(self.fc1(self.ln2(x))) @ self.fc2_w.T
        return x + self.all_reduce(part.contiguous()) + self.fc2_b


def shard(full: TinyCausalLM, rank: int, world: int, all_reduce: AllReduce) -> TinyCausalLM:
    """`full` with its blocks replaced by their shards for `rank` (in place:
    build a fresh full model per rank). The forward is TinyCausalLM's own."""
    blocks = [cast(Block, b) for b in full.blocks]  # ModuleList's items are typed Module
    if blocks and blocks[0].n_heads % world:
        raise ValueError(f"{blocks[0].n_heads} heads do not split over {world} ranks")
    full.blocks = nn.ModuleList(TPBlock(b, rank, world, all_reduce) for b in blocks)
    return full.eval()
