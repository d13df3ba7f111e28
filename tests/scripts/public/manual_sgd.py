"""A hand-written SGD loop, no torch.optim, in the shape of pytorch/examples' word language model (its original
LSTM form): zero the gradients, backward, clip, then `p.data.add_(p.grad, alpha=-lr)` for every parameter.

    python manual_sgd.py OUT [STEPS]
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class RNNModel(nn.Module):
    def __init__(self, ntoken=32, ninp=16, nhid=16):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, x):
        output, _ = self.rnn(self.encoder(x))
        return self.decoder(output)


out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
torch.manual_seed(0)
model = RNNModel()
lr = 2.0
losses = []
for step in range(steps):
    data = torch.randint(32, (4, 9))
    model.zero_grad()
    output = model(data[:, :-1])
    loss = F.cross_entropy(output.reshape(-1, 32), data[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    losses.append(loss.item())
torch.save({"losses": losses, "state": model.state_dict()}, out)
