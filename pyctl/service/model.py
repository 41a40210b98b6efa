"""TinyCausalLM: a small GPT-style decoder with seeded random weights.

The weights are random (no checkpoint can be downloaded here, and the
experiments measure the serving stack, not the text), but the compute is a
real transformer: embeddings, pre-norm blocks of causal self-attention
(scaled_dot_product_attention) and an MLP, tied output projection. The same
seed gives the same weights on every machine, so answers are reproducible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        # (B, T, D) -> (B, H, T, D/H)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    def __init__(
        self, vocab_size: int, d_model: int, n_heads: int, n_layers: int, max_context: int
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.n_layers = n_layers
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Logits of the LAST position of each row.

        ids: (B, T) token ids, left-padded; valid: (B, T) bool, False on padding.
        """
        t = ids.shape[1]
        # Positions count only real tokens, so left padding does not shift them.
        pos = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        x = self.tok_emb(ids) + self.pos_emb(pos)
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        # A query may see earlier real keys; padding queries see themselves
        # only, so no row of the mask is all False (that would give NaN).
        eye = torch.eye(t, dtype=torch.bool, device=ids.device)
        mask = (causal & valid[:, None, :]) | eye
        mask = mask[:, None, :, :]  # (B, 1, T, T), broadcast over heads
        for blk in self.blocks:
            x = blk(x, mask)
        last = self.ln_f(x[:, -1, :])
        return last @ self.tok_emb.weight.T  # tied output projection


def build_model(
    *,
    vocab_size: int,
    d_model: int,
    n_heads: int,
    n_layers: int,
    max_context: int,
    seed: int,
    device: str = "cpu",
) -> TinyCausalLM:
    """A model with weights drawn from `seed` (independent of the global RNG)."""
    # fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = TinyCausalLM(vocab_size, d_model, n_heads, n_layers, max_context)
    return m.to(device).eval()
