"""Incremental decoding of the char transformer with a slot-based KV cache.

The training forward (workload/model.py) recomputes the whole window; here each running sequence
owns a slot of a preallocated cache ``[layers] x (slots, heads, context, head_dim)`` for keys and
for values, so a decode step costs one token per sequence and sequences of different lengths
share one batched step (continuous batching): a boolean mask hides each slot's unused positions.

The model is small, so a step costs what its number of tensor operations costs, not arithmetic;
hence: the functional ops on the modules' own weights (no ``Module.__call__`` per layer), each new
key/value written into the cache in place (one indexed write per layer), attention over a view of
the cache when the running slots are 0..B-1 (the engine hands out low slots first; a gather
otherwise) and only as far as the longest sequence, and equal-length prompts prefilled in one
batch. Tested equal to the training forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx.workload.model import Block, CharTransformer


class KvDecoder:
    def __init__(self, model: CharTransformer, slots: int) -> None:
        self.model = model
        self.slots = slots
        self.n_heads = model.blocks[0].n_heads
        self.d_model = model.tok.weight.shape[1]
        self.context = model.pos.weight.shape[0]
        self.head_dim = self.d_model // self.n_heads
        self.device = model.tok.weight.device
        shape = (slots, self.n_heads, self.context, self.head_dim)
        self.k = [torch.zeros(shape, device=self.device) for _ in model.blocks]
        self.v = [torch.zeros(shape, device=self.device) for _ in model.blocks]
        self.positions = torch.arange(self.context, device=self.device)

    def prefill(self, slot: int, ids: list[int]) -> torch.Tensor:
        """Run a whole prompt into ``slot``; returns the logits after its last token."""
        return self.prefill_many([slot], [ids])[0]

    @torch.inference_mode()
    def prefill_many(self, slots: list[int], ids: list[list[int]]) -> torch.Tensor:
        """Prompts of one length into ``slots`` in one batched forward; returns (B, vocab): the logits after
        each prompt's last token."""
        t = len(ids[0])
        assert 0 < t <= self.context and len(slots) == len(ids) and all(len(x) == t for x in ids)
        m = self.model
        s = torch.tensor(slots, device=self.device)
        x = F.embedding(torch.tensor(ids, device=self.device), m.tok.weight) + m.pos.weight[:t]
        for i, blk in enumerate(m.blocks):
            q, k, v = self._qkv(blk, x)
            self.k[i][s, :, :t] = k
            self.v[i][s, :, :t] = v
            x = self._finish(blk, x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self._logits(x[:, -1])

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of ``slots`` at ``positions`` (its current length); returns (B, vocab) logits."""
        m = self.model
        b = len(slots)
        s = torch.tensor(slots, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        x = (F.embedding(torch.tensor(tokens, device=self.device), m.tok.weight) + m.pos.weight[pos]).unsqueeze(1)
        span = max(positions) + 1  # no sequence attends further
        view = slots == list(range(b))
        mask = (self.positions[None, :span] <= pos[:, None])[:, None, None, :]  # (B, 1, 1, span)
        for i, blk in enumerate(m.blocks):
            q, k, v = self._qkv(blk, x)  # (B, H, 1, hd) each
            kc, vc = self.k[i], self.v[i]
            kc[s, :, pos] = k[:, :, 0]
            vc[s, :, pos] = v[:, :, 0]
            if view:
                ks, vs = kc[:b, :, :span], vc[:b, :, :span]
            else:
                ks, vs = kc[s, :, :span], vc[s, :, :span]
            x = self._finish(blk, x, F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask))
        return self._logits(x[:, 0])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        ln = self.model.ln
        return F.linear(F.layer_norm(x, (self.d_model,), ln.weight, ln.bias, ln.eps), self.model.head.weight,
                        self.model.head.bias)

    def _qkv(self, blk: Block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        h = F.layer_norm(x, (d,), blk.ln1.weight, blk.ln1.bias, blk.ln1.eps)
        qkv = F.linear(h, blk.qkv.weight, blk.qkv.bias).view(b, t, 3, self.n_heads, self.head_dim)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, H, t, hd)
        return qkv[0], qkv[1], qkv[2]

    @staticmethod
    def _finish(blk: Block, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = att.shape
        d = x.shape[-1]
        x = x + F.linear(att.transpose(1, 2).reshape(b, t, d), blk.proj.weight, blk.proj.bias)
        ff, act, out = blk.mlp[0], blk.mlp[1], blk.mlp[2]
        h = F.layer_norm(x, (d,), blk.ln2.weight, blk.ln2.bias, blk.ln2.eps)
        return x + F.linear(F.gelu(F.linear(h, ff.weight, ff.bias), approximate=act.approximate), out.weight, out.bias)
