"""A 3-layer MLP trained with AdamW whose gradients the script changes between backward and step, by one of the
ways torch offers (or none):

    python grad_edits.py OUT [STEPS] [HOW] [fused]     (fused: AdamW(fused=True))

HOW: none, norm (clip_grad_norm_), value (clip_grad_value_), total_norm (get_total_norm + clip_grads_with_norm_,
torch >= 2.6), foreach (torch._foreach_mul_ over the gradients), scaler (GradScaler's unscale_), inplace (p.grad.mul_),
data (p.grad.data.clamp_), replace (p.grad = p.grad * 0.5), closure (the whole step in optimizer.step(closure), clipping inside it).
"""

import sys

import torch
from torch import nn

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
how = sys.argv[3] if len(sys.argv) > 3 else "none"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=sys.argv[4:] == ["fused"] or None)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if how == "scaler" else None
data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(4)]


def edit() -> None:
    params = list(model.parameters())
    if how == "norm":
        nn.utils.clip_grad_norm_(params, 0.1)
    elif how == "value":
        nn.utils.clip_grad_value_(params, 0.01)
    elif how == "total_norm":
        norm = nn.utils.get_total_norm([p.grad for p in params])
        nn.utils.clip_grads_with_norm_(params, 0.1, norm)
    elif how == "foreach":
        torch._foreach_mul_([p.grad for p in params], 0.5)
    elif how == "inplace":
        for p in params:
            p.grad.mul_(0.5)
    elif how == "data":
        for p in params:
            p.grad.data.clamp_(-0.01, 0.01)
    elif how == "replace":
        for p in params:
            p.grad = p.grad * 0.5


losses = []
for i in range(steps):
    x, y = data[i % len(data)]
    if how == "closure":
        def closure():
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            return loss
        losses.append(optimizer.step(closure).item())
        continue
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        edit()
        optimizer.step()
    losses.append(loss.item())
torch.save({"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}, out)
