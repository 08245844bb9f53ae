"""Q1: what makes dynamo break or skip on today's plan.module."""
import torch, torch._dynamo as dynamo
from study.common import tiny_gpt, plan_for
torch.set_num_threads(1)
model, inputs = tiny_gpt()
plan = plan_for(model, inputs)
print(plan.schedule.regions and [(r.policy, len(r.nodes), len(r.save)) for r in plan.schedule.regions])
ex = dynamo.explain(plan.module)(*inputs)
print("graphs", ex.graph_count, "breaks", ex.graph_break_count, "ops", ex.op_count)
for b in ex.break_reasons:
    print("BREAK:", str(b.reason)[:400])
    for f in b.user_stack[-3:]:
        print("   ", f.filename.split('/')[-1], f.lineno, f.name)
dynamo.reset()
try:
    c = torch.compile(plan.module, fullgraph=True)
    c(*inputs).backward()
except Exception as e:
    print("FULLGRAPH:", type(e).__name__, str(e)[:1500])
