"""Incremental decoding of the char transformer with a slot-based KV cache.

The training forward (workload/model.py) recomputes the whole window; here each running sequence
owns a slot of a preallocated cache ``[layers][2] x (slots, heads, context, head_dim)``, so a decode
step costs one token per sequence and sequences of different lengths share one batched step
(continuous batching): a boolean mask hides each slot's unused positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx.workload.model import CharTransformer


class KvDecoder:
    def __init__(self, model: CharTransformer, slots: int) -> None:
        self.model = model
        self.slots = slots
        blk0 = model.blocks[0]
        self.n_heads = blk0.n_heads
        self.d_model = model.tok.weight.shape[1]
        self.context = model.pos.weight.shape[0]
        hd = self.d_model // self.n_heads
        dev = model.tok.weight.device
        self.k = [torch.zeros(slots, self.n_heads, self.context, hd, device=dev) for _ in model.blocks]
        self.v = [torch.zeros(slots, self.n_heads, self.context, hd, device=dev) for _ in model.blocks]

    @torch.no_grad()
    def prefill(self, slot: int, ids: list[int]) -> torch.Tensor:
        """Run a whole prompt into ``slot``; returns the logits after its last token."""
        assert 0 < len(ids) <= self.context
        m = self.model
        idx = torch.tensor([ids], device=m.tok.weight.device)
        t = len(ids)
        x = m.tok(idx) + m.pos(torch.arange(t, device=idx.device))
        for i, blk in enumerate(m.blocks):
            q, k, v = self._qkv(blk, x)
            self.k[i][slot, :, :t] = k[0]
            self.v[i][slot, :, :t] = v[0]
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = self._finish(blk, x, att)
        return m.head(m.ln(x))[0, -1]

    @torch.no_grad()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of ``slots`` at ``positions`` (its current length); returns (B, vocab) logits."""
        m = self.model
        dev = m.tok.weight.device
        s = torch.tensor(slots, device=dev)
        pos = torch.tensor(positions, device=dev)
        x = (m.tok(torch.tensor(tokens, device=dev)) + m.pos(pos)).unsqueeze(1)  # (B, 1, d)
        mask = (torch.arange(self.context, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
        rows = torch.arange(len(slots), device=dev)
        for i, blk in enumerate(m.blocks):
            q, k, v = self._qkv(blk, x)
            kc, vc = self.k[i][s], self.v[i][s]  # (B, H, C, hd) copies of the slots' caches
            kc[rows, :, pos] = k[:, :, 0]
            vc[rows, :, pos] = v[:, :, 0]
            self.k[i][s] = kc
            self.v[i][s] = vc
            att = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
            x = self._finish(blk, x, att)
        return m.head(m.ln(x))[:, 0]

    def _qkv(self, blk: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = blk.qkv(blk.ln1(x)).split(d, dim=2)
        shape = (b, t, self.n_heads, d // self.n_heads)
        return tuple(z.view(shape).transpose(1, 2) for z in (q, k, v))  # type: ignore[return-value]

    @staticmethod
    def _finish(blk: torch.nn.Module, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = att.shape
        x = x + blk.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + blk.mlp(blk.ln2(x))
