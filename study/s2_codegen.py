"""Q2/Q5: the code-generated executor in eager and under torch.compile: graphs, fullgraph,
gradients against the original model, peak memory (profiler memory events)."""
import copy, sys, time
import torch, torch._dynamo as dynamo
from torch._dynamo.utils import counters
from scheduler.capture.trace import trace
from study.codegen import generate
from scheduler.measurement.storage import base_bytes
import scheduler
from study.common import tiny_gpt, plan_for, grads, peak_profiler, record_saved_tensors, SAVED, saved_summary
record_saved_tensors()
torch.set_num_threads(1)

budgets = sys.argv[1:] or ["60%", "85%"]
model, inputs = tiny_gpt()
params = list(model.parameters())
ref_loss, ref_g = grads(model, inputs, params)

def step(m):
    def f():
        for p in params: p.grad = None
        m(*inputs).backward()
    return f

BASE = base_bytes(model, inputs)
def peak(m, warm=1):
    for _ in range(warm): step(m)()
    return BASE + peak_profiler(step(m))

res = {"model eager": peak(model)}
dynamo.reset()
cm = torch.compile(model)
res["model compiled"] = peak(cm)
print("model compiled:", saved_summary(SAVED[-1]))
res["model eager (scheduler.measure)"] = scheduler.measure(model, inputs, repeats=1).peak_bytes
for b in budgets:
    plan = plan_for(model, inputs, budget=b)
    regs = [(r.policy, len(r.nodes)) for r in plan.schedule.regions]
    print(f"budget {b}: {plan.schedule.budget_bytes} B, regions {regs}")
    gen = generate(trace(model, inputs), plan.schedule)
    # eager: bitwise equal to today's CheckpointedModule, close to the model
    l1, g1 = grads(plan.module, inputs, params)
    l2, g2 = grads(gen, inputs, params)
    assert all(torch.equal(a, c) for a, c in zip(g1, g2)) and torch.equal(l1, l2), "eager not bitwise"
    torch.testing.assert_close(g2, ref_g)
    print("  eager: bitwise equal to plan.module, close to model")
    dynamo.reset(); counters.clear()
    ex = dynamo.explain(gen)(*inputs)
    print(f"  explain: graphs {ex.graph_count}, breaks {ex.graph_break_count}, ops {ex.op_count}")
    dynamo.reset(); counters.clear()
    cg = torch.compile(gen, fullgraph=True)
    l3, g3 = grads(cg, inputs, params)
    torch.testing.assert_close(l3, ref_loss); torch.testing.assert_close(g3, ref_g)
    print(f"  fullgraph=True compiled: grads close to model; unique_graphs {counters['stats']['unique_graphs']}")
    print("  compiled:", saved_summary(SAVED[-1]))
    print("   in-region saved:", [x for x in SAVED[-1] if x[3] is not None])
    res[f"{b} budget"] = plan.schedule.budget_bytes
    res[f"{b} plan.module (scheduler.measure)"] = scheduler.measure(plan.module, inputs, repeats=1).peak_bytes
    res[f"{b} plan.module eager"] = peak(plan.module)
    res[f"{b} generated eager"] = peak(gen)
    res[f"{b} generated compiled"] = peak(cg)
    res[f"{b} predicted (plan.estimate)"] = plan.estimate.peak_bytes
    try:
        scheduler.measure(cg, inputs, repeats=1, loss_fn=lambda x: x)
    except RuntimeError as e:
        print("  scheduler.measure on the compiled module:", str(e).splitlines()[0][:100], "|", str(e).splitlines()[2].strip()[:120])
for k, v in res.items():
    print(f"{k:40s} {v if not isinstance(v, int) else f'{v/2**20:8.3f} MiB'}")
