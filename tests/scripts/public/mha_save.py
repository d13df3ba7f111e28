"""In the shape of pytorch/examples' word_language_model (transformer): nn.TransformerEncoder, whose attention calls
its out_proj through F.linear, and `torch.save(model)` of the whole module at the end.

    python mha_save.py OUT [STEPS]
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class TransformerModel(nn.Module):
    def __init__(self, ntoken=50, d=16, heads=2, layers=2):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, d)
        # bias=False: a key bias gets a zero gradient (softmax ignores it), which Adam would turn into steps of
        # rounding noise that no two Adam implementations take alike
        layer = nn.TransformerEncoderLayer(d, heads, 32, dropout=0.0, batch_first=True, bias=False)
        self.transformer_encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.decoder = nn.Linear(d, ntoken)

    def forward(self, src):
        mask = nn.Transformer.generate_square_subsequent_mask(src.size(1))
        return F.log_softmax(self.decoder(self.transformer_encoder(self.encoder(src), mask, is_causal=True)), -1)


out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
torch.manual_seed(0)
model = TransformerModel()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
losses = []
for step in range(steps):
    data = torch.randint(50, (4, 9))
    optimizer.zero_grad()
    output = model(data[:, :-1])
    loss = F.nll_loss(output.reshape(-1, 50), data[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
with open(out + ".model.pt", "wb") as f:
    torch.save(model, f)  # the whole module, as the example's --save does
with open(out + ".model.pt", "rb") as f:
    loaded = torch.load(f, weights_only=False)
os.remove(out + ".model.pt")
torch.save({"losses": losses, "state": loaded.state_dict(), "hooks": len(loaded._forward_pre_hooks)}, out)
