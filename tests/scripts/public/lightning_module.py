"""A PyTorch Lightning module trained by Lightning's `Trainer` on the CPU with automatic optimization (Lightning
calls `optimizer.step(closure)`, and the model runs inside the closure), gradient clipping by Lightning, and an
AdamW with a step-wise LR schedule.

    python lightning_module.py OUT [STEPS] [fused] [noclip]     (fused: AdamW(fused=True); noclip: no clipping)
"""

import sys

import torch
from torch import nn

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
fused = "fused" in sys.argv[3:] or None
clip = None if "noclip" in sys.argv[3:] else 0.5


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01, fused=fused)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


pl.seed_everything(0, verbose=False)
model = Regressor()
data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=clip, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, loader)
torch.save({"losses": model.losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}, out)
