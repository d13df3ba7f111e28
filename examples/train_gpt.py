"""Train a small GPT on synthetic text: the kind of script people write, and the one hetero's demo runs.

    python examples/train_gpt.py --steps 20
    hetero profile examples/train_gpt.py          # then: hetero plan, hetero run examples/train_gpt.py

Nothing here knows about hetero.
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_embd: int, n_head: int, recompute: bool = False):
        super().__init__()
        self.recompute = recompute  # torch.utils.checkpoint on every block: keep only block inputs, redo the rest
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for m in self.modules():  # GPT-2's init: small weights keep the first logits near uniform
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute and torch.is_grad_enabled() else block(x)
        return self.lm_head(self.ln_f(x))


def batches(vocab: int, batch_size: int, seq_len: int, seed: int, device: str):
    """Synthetic text with structure to learn: each sequence counts up from a random start with a random stride."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(vocab, (batch_size, 1), generator=g)
        stride = torch.randint(1, 4, (batch_size, 1), generator=g)
        seq = (start + stride * torch.arange(seq_len + 1)) % vocab
        yield seq[:, :-1].to(device), seq[:, 1:].to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm to this (0: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--checkpoint", action="store_true", help="recompute each block in backward (less memory)")
    parser.add_argument("--weight-sum", action="store_true", help="print the sum of the final weights (to compare runs)")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.seq_len, args.n_layer, args.n_embd, args.n_head, args.checkpoint).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = batches(args.vocab, args.batch_size, args.seq_len, args.seed, args.device)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on {args.device}")

    start = time.perf_counter()
    steady = None  # (step, time) from which the steady step time is measured: the second half of the run
    for step in range(1, args.steps + 1):
        if step == args.steps // 2 + 1:
            steady = (step, _synchronized(args.device))
        optimizer.zero_grad(set_to_none=True)
        for _ in range(args.grad_accum):
            x, y = next(data)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.grad_accum
            loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - start
            print(f"step {step:4d}  loss {loss.item() * args.grad_accum:.4f}  {elapsed / step * 1e3:.0f} ms/step")
    if steady is not None and steady[0] <= args.steps:
        done = args.steps - steady[0] + 1
        print(f"steady {(_synchronized(args.device) - steady[1]) / done * 1e3:.2f} ms/step over the last {done} steps")
    if args.weight_sum:  # in float64, one parameter at a time (a copy of the whole model would not fit where it must)
        with torch.no_grad():
            total = sum(p.double().sum().item() for p in model.parameters())
            absolute = sum(p.double().abs().sum().item() for p in model.parameters())
        print(f"weight sum {total!r}  abs sum {absolute!r}")


def _synchronized(device: str) -> float:
    """The time once every kernel issued so far has run (a GPU computes asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


if __name__ == "__main__":
    main()
