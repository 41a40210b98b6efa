"""Batched decoding: one forward per generated token for the whole batch.

Prompts are left-padded to one length so the next token of every row is
at the last position. There is no KV cache: the tiny model recomputes the
sequence each step (a few hundred microseconds on a CPU), which keeps the
code short; a step hook lets the device backend do its per-step work (the
double's kernel launch and synchronize) and raise device errors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pyctl.service.model import TinyCausalLM


@dataclass
class GenRequest:
    ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0


def generate(
    model: TinyCausalLM,
    reqs: Sequence[GenRequest],
    *,
    pad_id: int,
    banned: Sequence[int] = (),
    device: str | torch.device = "cpu",
    on_step: Callable[[int], None] | None = None,
    sync_next: Callable[[torch.Tensor], torch.Tensor] | None = None,
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> list[list[int]]:
    """The generated ids of each request (exactly max_tokens each).

    on_tokens (streaming): called after each step with the step number and
    the token each row chose (a row whose max_tokens is reached has one
    too: the caller ignores it), so an answer can leave token by token.

    sync_next (two ranks): called with each step's chosen tokens (B,), it
    returns the tokens every rank continues with: rank 0 broadcasts its
    own, so rank 1 never samples on its own (pyctl/service/ranks.py)."""
    if not reqs:
        return []
    steps = max(r.max_tokens for r in reqs)
    width = max(len(r.ids) for r in reqs)
    rows = [[pad_id] * (width - len(r.ids)) + r.ids for r in reqs]
    ids = torch.tensor(rows, dtype=torch.long, device=device)
    valid = torch.tensor(
        [[False] * (width - len(r.ids)) + [True] * len(r.ids) for r in reqs], device=device
    )
    temps = torch.tensor([max(r.temperature, 0.0) for r in reqs], device=device)
    gens = [torch.Generator(device="cpu").manual_seed(r.seed) for r in reqs]
    ban = torch.tensor(list(banned), dtype=torch.long, device=device)
    out: list[list[int]] = [[] for _ in reqs]
    with torch.inference_mode():
        for step in range(steps):
            if on_step is not None:
                on_step(step)
            # Keep at most max_context positions (the oldest fall out).
            ids_in, valid_in = ids[:, -model.max_context :], valid[:, -model.max_context :]
            logits = (forward or model)(ids_in, valid_in).float()
            if len(ban):
                # Specials are never sampled: every answer is max_tokens long.
                logits[:, ban] = float("-inf")
            nxt = logits.argmax(dim=-1)
            for i, t in enumerate(temps.tolist()):
                if t > 0:
                    p = torch.softmax(logits[i] / t, dim=-1).cpu()
                    nxt[i] = int(torch.multinomial(p, 1, generator=gens[i]).item())
            if sync_next is not None:
                nxt = sync_next(nxt)
            chosen = nxt.tolist()
            for i, tok in enumerate(chosen):
                if step < reqs[i].max_tokens:
                    out[i].append(tok)
            if on_tokens is not None:
                on_tokens(step, chosen)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            valid = torch.cat([valid, torch.ones_like(nxt[:, None], dtype=torch.bool)], dim=1)
    return out
