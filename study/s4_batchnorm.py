"""Q4: BatchNorm buffers inside a recompute region: updated once per step? (eager
CheckpointedModule, generated executor eager, generated executor compiled)."""
import copy
import torch, torch.nn as nn, torch._dynamo as dynamo
import scheduler
from scheduler.capture.program import Program
from scheduler.capture.trace import trace
from scheduler.ir.schedule import Region, Schedule
from study.codegen import generate, CheckpointRegion
torch.set_num_threads(1)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8 * 8 * 8, 10)
    def forward(self, x):
        return self.head(self.body(x).flatten(1)).square().mean()

torch.manual_seed(0)
model = Net().train()
x = torch.randn(4, 3, 8, 8)
gm = trace(model, (x,))
prog = Program(gm)
names = [n.name for n in prog.nodes if n.name not in prog.info.loss_nodes]
print("nodes:", names)
sched = Schedule([Region("recompute", tuple(names[:6])), Region("keep", tuple(names[6:]))])
state0 = copy.deepcopy(model.state_dict())

def run(make, steps=3, compiled=False):
    model.load_state_dict(state0)
    m = make()
    for _ in range(steps):
        for p in model.parameters(): p.grad = None
        m(x).backward()
    bufs = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    return bufs, [p.grad.clone() for p in model.parameters()]

ref_b, ref_g = run(lambda: model)
cases = {
    "plan.module (CheckpointedModule)": lambda: scheduler.apply(model, sched, (x,)),
    "generated eager": lambda: generate(gm, sched),
}
def compiled_gen():
    dynamo.reset()
    return torch.compile(generate(gm, sched), fullgraph=True)
def compiled_gen_no_restore():
    dynamo.reset()
    g = generate(gm, sched)
    for mod in g.modules():
        if isinstance(mod, CheckpointRegion):
            object.__setattr__(mod, "_buffers_mut", [])
    return g
cases["generated compiled (fullgraph)"] = compiled_gen
cases["generated eager WITHOUT buffer restore"] = compiled_gen_no_restore
for name, make in cases.items():
    b, g = run(make)
    ok_b = all(torch.allclose(b[k], ref_b[k]) for k in ref_b)
    nbt = {k: int(v) for k, v in b.items() if "num_batches" in k}
    try:
        torch.testing.assert_close(g, ref_g); ok_g = True
    except AssertionError:
        ok_g = False
    print(f"{name:40s} buffers equal: {ok_b}  num_batches_tracked {nbt}  grads close: {ok_g}")
print("reference num_batches_tracked", {k: int(v) for k, v in ref_b.items() if "num_batches" in k})

# the same with a save set (conv outputs MUST_SAVE) in the BatchNorm region
sched = Schedule([Region("recompute", tuple(names[:6]), frozenset({"model_body_0", "model_body_3"})),
                  Region("keep", tuple(names[6:]))])
for name, make in {"save-set plan.module": lambda: scheduler.apply(model, sched, (x,)),
                   "save-set generated eager": lambda: generate(gm, sched),
                   "save-set generated compiled": compiled_gen}.items():
    b, g = run(make)
    ok_b = all(torch.allclose(b[k], ref_b[k]) for k in ref_b)
    nbt = {k: int(v) for k, v in b.items() if "num_batches" in k}
    try:
        torch.testing.assert_close(g, ref_g); ok_g = True
    except AssertionError:
        ok_g = False
    print(f"{name:40s} buffers equal: {ok_b}  num_batches_tracked {nbt}  grads close: {ok_g}")
