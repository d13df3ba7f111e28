"""Knowledge distillation: a frozen teacher (eval mode, no gradients) and a smaller student trained with Adam on a
mix of the teacher's softened outputs (KL divergence at a temperature) and the labels.

    python distill.py OUT [STEPS]
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
teacher.eval().requires_grad_(False)
optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
T, alpha = 2.0, 0.5
losses = []
for step in range(steps):
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    with torch.no_grad():
        soft = F.softmax(teacher(x) / T, dim=-1)
    logits = student(x)
    kd = F.kl_div(F.log_softmax(logits / T, dim=-1), soft, reduction="batchmean") * T * T
    loss = alpha * kd + (1 - alpha) * F.cross_entropy(logits, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
torch.save({"losses": losses, "state": student.state_dict()}, out)
