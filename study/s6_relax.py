"""A solver-made schedule with save sets (relax), run through the generated executor: eager
bitwise vs plan.module, compiled fullgraph grads vs the model, peaks (profiler)."""
import torch, torch._dynamo as dynamo
import scheduler
from scheduler.capture.trace import trace
from scheduler.measurement.storage import base_bytes
from study.codegen import generate
from study.common import tiny_gpt, grads, peak_profiler, record_saved_tensors, SAVED, saved_summary
torch.set_num_threads(1)
record_saved_tensors()
model, inputs = tiny_gpt()
params = list(model.parameters())
plan = scheduler.solve(model, inputs, budget="55%", solver="relax", time_limit_s=30)
print("regions", [(r.policy, len(r.nodes), len(r.save)) for r in plan.schedule.regions], plan.status)
gen = generate(trace(model, inputs), plan.schedule)
l0, g0 = grads(model, inputs, params)
l1, g1 = grads(plan.module, inputs, params)
l2, g2 = grads(gen, inputs, params)
print("eager bitwise vs plan.module:", torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2)))
dynamo.reset()
c = torch.compile(gen, fullgraph=True)
l3, g3 = grads(c, inputs, params)
torch.testing.assert_close(g3, g0); print("compiled grads close to model")
print("compiled:", saved_summary(SAVED[-1]))
BASE = base_bytes(model, inputs)
def peak(m):
    def f():
        for p in params: p.grad = None
        m(*inputs).backward()
    f(); return BASE + peak_profiler(f)
print(f"budget {plan.schedule.budget_bytes/2**20:.3f} MiB, predicted {plan.estimate.peak_bytes/2**20:.3f}")
for name, m in [("model", model), ("plan.module", plan.module), ("generated eager", gen), ("generated compiled", c)]:
    print(f"peak {name:20s} {peak(m)/2**20:.3f} MiB")
