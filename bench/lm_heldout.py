"""A GPT-style language model written apart from examples/train_gpt.py, the way a user would write one (fused QKV,
PyTorch's scaled-dot-product attention, tied embeddings, AdamW with a warm-up schedule), for checking hetero on a
script it was not tuned for. Prints the final loss, the weights' float64 sum and the steady step time.

    python bench/lm_heldout.py --device cuda --width 1024 --blocks 8 --vocab 16384 --batch 8 --seq 512 --steps 30
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int, seq: int, width: int, blocks: int, heads: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    model = LM(a.vocab, a.seq, a.width, a.blocks, a.heads).to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    data = torch.Generator().manual_seed(a.seed)
    cuda = torch.device(a.device).type == "cuda"
    start = None
    for step in range(a.steps):
        if step == a.steps // 2:
            torch.cuda.synchronize() if cuda else None
            start = time.perf_counter()
        tokens = torch.randint(a.vocab, (a.batch, a.seq + 1), generator=data).to(a.device)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
    torch.cuda.synchronize() if cuda else None
    steady = (time.perf_counter() - start) / (a.steps - a.steps // 2)
    with torch.no_grad():
        weights = math.fsum(p.double().sum().item() for p in model.parameters())
    print(f"final loss {loss.item()!r}")
    print(f"weight sum {weights!r}")
    print(f"steady {steady * 1e3:.2f} ms/step over the last {a.steps - a.steps // 2} steps")


if __name__ == "__main__":
    main()
