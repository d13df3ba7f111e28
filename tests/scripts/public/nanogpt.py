"""In the shape of nanoGPT's train.py: AdamW with decay/no-decay groups, a cosine LR set per step, gradient
accumulation, clipping, an EMA copy made with deepcopy, a 'best model' snapshot, and a checkpoint dict.

    python nanogpt.py OUT [STEPS]     (OUT receives the losses and the final weights)
"""

import copy
import io
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        # bias=False, nanoGPT's recommended config: a key bias gets a zero gradient (softmax ignores it), which Adam
        # would turn into steps of rounding noise that no two Adam implementations take alike
        self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, block_size=16, d=32, heads=2, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def get_lr(it, warmup=2, max_iters=12, lr=1e-3, min_lr=1e-4):
    if it < warmup:
        return lr * (it + 1) / warmup
    ratio = (it - warmup) / (max_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


out, max_iters = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 12
torch.manual_seed(1337)
data = torch.randint(64, (4096,))
model = GPT()
optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
ema, best, losses, accumulation = None, None, [], 2


def get_batch():
    ix = torch.randint(len(data) - 17, (4,))
    return torch.stack([data[i:i + 16] for i in ix]), torch.stack([data[i + 1:i + 17] for i in ix])


for it in range(max_iters):
    for group in optimizer.param_groups:
        group["lr"] = get_lr(it, max_iters=max_iters)
    model.train()
    for micro_step in range(accumulation):
        x, y = get_batch()
        _, loss = model(x, y)
        (loss / accumulation).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())
    if ema is None:  # after the first step: hetero's hooks are on the model by now
        ema = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 0.1)
        model.eval()
        _, val = ema(*get_batch())
    if best is None or val.item() < best[0]:
        best = (val.item(), copy.deepcopy(model.state_dict()))
    if it == 3:  # a checkpoint, as nanoGPT writes one
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": it}, io.BytesIO())
torch.save({"losses": losses, "state": model.state_dict(), "ema": ema.state_dict()}, out)
