"""A partitioned model compiled with torch._dynamo imported before
zeroshard.torch (argv[1] "first", as compile_worker.py does) or only when
torch.compile loads it ("later": zeroshard.torch itself does not, 0.6-0.7 s
of CPU at every rank's start): each step's loss and dynamo's counts of frames,
graphs and graph breaks as one JSON line, which test_torch_compile.py
compares between the two."""
import json
import sys

if sys.argv[1] == "first":
    import torch._dynamo  # noqa: F401
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroshard.torch as zt

if sys.argv[1] != "first" and "torch._dynamo" in sys.modules:
    raise SystemExit("importing zeroshard.torch loaded torch._dynamo")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):  # code between the units' hooks, which compiles
        h = F.gelu(self.a(x)) * 1.5 + x
        return torch.tanh(self.b(h)) + h.mean(dim=-1, keepdim=True)


torch.manual_seed(0)
with zt.Init(config={"train_micro_batch_size_per_gpu": 1}):
    model = nn.Sequential(Block(), Block())
zt.partition_module(model)
opt = zt.ZeroShardOptimizer(list(model.parameters()), lr=1e-2)
compiled = torch.compile(model, backend="eager")  # dynamo's counts without inductor's codegen
losses = []
for step in range(3):
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(step))
    loss = compiled(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
from torch._dynamo.utils import counters  # noqa: E402
print(json.dumps({"losses": losses, "frames": dict(counters["frames"]), "graphs": counters["stats"]["unique_graphs"],
                  "breaks": sum(counters["graph_break"].values())}))
