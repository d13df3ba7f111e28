"""A hand-written SGD loop, no torch.optim.

    python manual_sgd.py OUT [STEPS]
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
losses = []
for step in range(steps):
    loss = F.cross_entropy(model(torch.randn(8, 16)), torch.randint(4, (8,)))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    losses.append(loss.item())
torch.save({"losses": losses, "state": model.state_dict()}, out)
