"""A GPT-style language model written apart from hetero's own example, in a shape this project did not tune for.

    python bench/heldout_lm.py                                  # width 512, 8 blocks, vocab 8192, batch 4 x 256
    python bench/heldout_lm.py --width 256 --blocks 4 --context 1024 --batch 2      # activation-heavy: long context

It differs from examples/train_gpt.py where scripts in the wild do: pre-norm blocks calling
F.scaled_dot_product_attention, a SwiGLU feed-forward, an untied output head, AdamW with two parameter groups (no
weight decay on norms and biases), a cosine learning-rate schedule, and an evaluation pass after training. Nothing
here knows about hetero; benchmarks run it as a user would (bench/cap.py --script heldout, bench/memory.py).
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        hidden = 256 * math.ceil(8 * width / 3 / 256)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, dropout)
        self.norm2 = nn.LayerNorm(width)
        self.ff = SwiGLU(width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.ff(self.norm2(x)))


class LanguageModel(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, blocks: int, heads: int, dropout: float,
                 recompute: bool):
        super().__init__()
        self.recompute = recompute
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions[: idx.size(1)]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute and self.training else block(x)
        return self.head(self.norm(x))


def corpus(vocab: int, batch: int, context: int, seed: int):
    """Synthetic text: runs of a few tokens repeated with noise, so the loss falls as it learns."""
    g = torch.Generator().manual_seed(seed)
    while True:
        motif = torch.randint(vocab, (batch, 8), generator=g)
        seq = motif.repeat(1, (context + 1) // 8 + 1)[:, : context + 1]
        noise = torch.rand(seq.shape, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(vocab, seq.shape, generator=g), seq)
        yield seq[:, :-1], seq[:, 1:]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--eval-batches", type=int, default=2, help="batches evaluated after training")
    p.add_argument("--checkpoint", action="store_true", help="recompute every block in backward")
    p.add_argument("--weight-sum", action="store_true", help="print the sum of the final weights")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    model = LanguageModel(args.vocab, args.context, args.width, args.blocks, args.heads, args.dropout,
                          args.checkpoint)
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2]
    no_decay = [q for n, q in model.named_parameters() if q.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    data = corpus(args.vocab, args.batch, args.context, args.seed)
    print(f"{sum(q.numel() for q in model.parameters()) / 1e6:.2f}M parameters")

    model.train()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(data)
        loss = F.cross_entropy(model(x).view(-1, args.vocab), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}  {(time.perf_counter() - start) / step * 1e3:.0f} ms/step",
                  flush=True)
    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(x).view(-1, args.vocab), y.reshape(-1)).item()
                  for x, y in (next(data) for _ in range(args.eval_batches))]
    if losses:
        print(f"eval loss {sum(losses) / len(losses):.4f}")
    if args.weight_sum:
        with torch.no_grad():
            total = sum(q.double().sum().item() for q in model.parameters())
            absolute = sum(q.double().abs().sum().item() for q in model.parameters())
        print(f"weight sum {total!r}  abs sum {absolute!r}")


if __name__ == "__main__":
    main()
