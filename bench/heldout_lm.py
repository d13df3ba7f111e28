"""A GPT-style language model written apart from hetero's own example, in a shape this project did not tune for.

    python bench/heldout_lm.py                                  # width 512, 8 blocks, vocab 8192, batch 4 x 256
    python bench/heldout_lm.py --width 256 --blocks 4 --context 1024 --batch 2      # activation-heavy: long context
    python bench/heldout_lm.py --device cuda --tied --width 1024 --blocks 8 --heads 16 --vocab 16384 --batch 8 \
        --context 512 --steps 30 --weight-sum       # the model of bench/gpu_all.py's `heldout` piece: 120M parameters

It differs from examples/train_gpt.py where scripts in the wild do: pre-norm blocks calling
F.scaled_dot_product_attention, a SwiGLU feed-forward, an untied output head (tied to the token embedding with
--tied), AdamW with two parameter groups (no weight decay on norms and biases), a cosine learning-rate schedule, and
an evaluation pass after training. Nothing here knows about hetero; benchmarks run it as a user would (bench/cap.py
--script heldout, bench/memory.py, bench/gpu_e2e.py from bench/gpu_all.py).

Its last lines are what benchmarks compare runs by: the last training step's loss (`final loss`), with --weight-sum
the float64 sum of the final weights, and the steady step time (`steady`: the mean over the second half of the
steps, the device synchronized at both ends).
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
                 recompute: bool, tied: bool = False):
        super().__init__()
        self.recompute = recompute
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.apply(self._init)
        if tied:  # after the initialisation: one tensor, drawn once
            self.head.weight = self.tokens.weight

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
    p.add_argument("--device", default="cpu", help="where the model trains: cpu, cuda, cuda:1...")
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
    p.add_argument("--tied", action="store_true", help="the output head shares the token embedding's weight")
    p.add_argument("--weight-sum", action="store_true", help="print the sum of the final weights")
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = LanguageModel(args.vocab, args.context, args.width, args.blocks, args.heads, args.dropout,
                          args.checkpoint, args.tied).to(device)
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2]
    no_decay = [q for n, q in model.named_parameters() if q.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    data = corpus(args.vocab, args.batch, args.context, args.seed)
    print(f"{sum(q.numel() for q in model.parameters()) / 1e6:.2f}M parameters")

    def synchronize():  # CUDA runs behind the host: a time taken without waiting would be of the launches
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    model.train()
    start = time.perf_counter()
    steady_from = args.steps // 2 + 1  # the first half warms up (CUDA's kernels, the allocator's pools)
    for step in range(1, args.steps + 1):
        if step == steady_from:
            synchronize()
            steady_start = time.perf_counter()
        x, y = (t.to(device) for t in next(data))
        loss = F.cross_entropy(model(x).view(-1, args.vocab), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}  {(time.perf_counter() - start) / step * 1e3:.0f} ms/step",
                  flush=True)
    synchronize()
    steady = (time.perf_counter() - steady_start) / (args.steps - steady_from + 1)
    final = loss.item()
    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(x).view(-1, args.vocab), y.reshape(-1)).item()
                  for x, y in ((t.to(device) for t in next(data)) for _ in range(args.eval_batches))]
    if losses:
        print(f"eval loss {sum(losses) / len(losses):.4f}")
    # the training loss last of the losses: readers take the last `loss` printed (bench/gpu_e2e.py)
    print(f"final loss {final!r}")
    if args.weight_sum:
        with torch.no_grad():
            total = sum(q.double().sum().item() for q in model.parameters())
            absolute = sum(q.double().abs().sum().item() for q in model.parameters())
        print(f"weight sum {total!r}  abs sum {absolute!r}")
    print(f"steady {steady * 1e3:.2f} ms/step over the last {args.steps - steady_from + 1} steps")


if __name__ == "__main__":
    main()
