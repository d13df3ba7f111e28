"""In the shape of pytorch/examples' word_language_model (LSTM): an RNNModel of Embedding, LSTM and Linear trained
with a hand-written SGD update after clip_grad_norm_, hidden state carried across batches (detached), and
`torch.save(model)` of the whole module at each epoch's end, loaded back as the example's test does.

    python lstm_save.py OUT [STEPS]
"""

import copy
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class RNNModel(nn.Module):
    def __init__(self, ntoken=50, ninp=16, nhid=32, nlayers=2):
        super().__init__()
        self.drop = nn.Dropout(0.0)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=0.0)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nlayers, self.nhid = nlayers, nhid

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, 50)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
torch.manual_seed(0)
model = RNNModel()
data = torch.randint(50, (steps * 8 + 1, 4))  # (sequence, batch)
lr, losses, epoch_steps = 0.5, [], 4
hidden = model.init_hidden(4)
for step in range(steps):
    model.train()
    x, y = data[step * 8:step * 8 + 8], data[step * 8 + 1:step * 8 + 9]
    hidden = repackage_hidden(hidden)
    model.zero_grad()
    output, hidden = model(x, hidden)
    loss = F.nll_loss(output, y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    losses.append(loss.item())
    if step % epoch_steps == epoch_steps - 1:  # an epoch's end: the example saves the whole model
        with open(out + ".model.pt", "wb") as f:
            torch.save(model, f)
        twin = copy.deepcopy(model)
with open(out + ".model.pt", "rb") as f:
    loaded = torch.load(f, weights_only=False)
    loaded.rnn.flatten_parameters()
os.remove(out + ".model.pt")
hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in [*loaded.modules(), *twin.modules()])
torch.save({"losses": losses, "state": loaded.state_dict(), "hooks": hooks}, out)
