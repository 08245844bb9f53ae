"""Q5: eager Python overhead of the generated executor vs the interpreter (CheckpointedModule),
1 thread, rough: the min over repeated steps; a tiny model so overhead dominates."""
import time
import torch
from scheduler.capture.trace import trace
from study.codegen import generate
from study.common import tiny_gpt, plan_for
torch.set_num_threads(1)

for sizes in [dict(batch=1, block_size=8, n_embd=16, n_head=2, n_layer=4, vocab_size=32),
              dict()]:
    model, inputs = tiny_gpt(**sizes)
    plan = plan_for(model, inputs, budget=10**9 if sizes else "60%", solver="every_block")
    gen = generate(trace(model, inputs), plan.schedule)
    params = list(model.parameters())
    def t(m, n=40):
        best_f = best_s = 1e9
        for _ in range(n):
            for p in params: p.grad = None
            t0 = time.perf_counter(); loss = m(*inputs); t1 = time.perf_counter(); loss.backward()
            t2 = time.perf_counter()
            best_f, best_s = min(best_f, t1 - t0), min(best_s, t2 - t0)
        return best_f * 1e3, best_s * 1e3
    print(sizes or "study size", [(r.policy, len(r.nodes)) for r in plan.schedule.regions])
    for name, m in [("model", model), ("plan.module", plan.module), ("generated", gen)]:
        f, s = t(m)
        print(f"  {name:12s} forward {f:7.3f} ms  step {s:7.3f} ms")
