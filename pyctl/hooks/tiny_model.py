"""A tiny decoder-only transformer with random weights, built in-process.

Every projection is an nn.Linear and attention uses torch.matmul, so both
the module hooks and the matmul mode of tc_perturb see them (PyTorch's
fused encoder fast path would hide them). No downloads.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int = 512, d: int = 64, heads: int = 4, layers: int = 2, ctx: int = 64
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.emb(ids) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))  # logits


def build(
    seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw: int
) -> TinyLM:
    """A TinyLM whose random weights depend only on `seed`."""
    torch.manual_seed(seed)
    return TinyLM(**kw).to(device=device, dtype=dtype).eval()


def batch(
    seed: int = 1, b: int = 8, t: int = 32, vocab: int = 512, device: str = "cpu"
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t + 1), generator=g).to(device)
