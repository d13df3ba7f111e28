"""A Hugging Face `Trainer` on a GPT2LMHeadModel built from a tiny config, on synthetic tokens (no download).

    python hf_trainer.py OUT [STEPS] [fused] [noclip]

The Trainer clips gradients at its default `max_grad_norm=1.0` (noclip: 0); fused: `optim="adamw_torch_fused"`.
"""

import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
fused, clip = "fused" in sys.argv[3:], "noclip" not in sys.argv[3:]
torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(64, (64, 16))]
losses = []


class Losses(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            losses.append(float(logs["loss"]))


with tempfile.TemporaryDirectory() as output_dir:
    args = TrainingArguments(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=1e-3, weight_decay=0.1, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                             dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=1.0 if clip else 0.0,
                             optim="adamw_torch_fused" if fused else "adamw_torch")
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Losses()]).train()
torch.save({"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}, out)
