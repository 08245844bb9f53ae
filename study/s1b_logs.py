"""Q1: non-fullgraph compile of today's plan.module, with graph-break logs and counters."""
import torch, torch._dynamo as dynamo
from torch._dynamo.utils import counters
from study.common import tiny_gpt, plan_for
torch.set_num_threads(1)
model, inputs = tiny_gpt()
plan = plan_for(model, inputs)
c = torch.compile(plan.module)
loss = c(*inputs); loss.backward()
print("stats", dict(counters["stats"]))
print("graph_break", {k[:300]: v for k, v in counters["graph_break"].items()})
print("unimplemented", dict(counters["unimplemented"]))
print("frames", dict(counters["frames"]))
