"""Q3: save sets under compile. Annotated save-set nodes + a pure policy reading
fx_traceback.current_meta["custom"]; what the partitioner saves; the op stream the policy sees
in eager and under compile (would an op-ordinal key work?); dropout with save sets."""
import sys
from collections import Counter
import torch, torch._dynamo as dynamo
import torch._inductor.config as iconfig
from torch.utils.checkpoint import CheckpointPolicy
import scheduler
from scheduler.capture.trace import trace
from scheduler.ir.schedule import Region, Schedule
import study.codegen as cg_mod
from study.codegen import generate
from study.common import tiny_gpt, plan_for, grads, peak_profiler, record_saved_tensors, SAVED, saved_summary
from scheduler.measurement.storage import base_bytes
torch.set_num_threads(1)
record_saved_tensors()

dropout = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
model, inputs = tiny_gpt(dropout=dropout)
params = list(model.parameters())
plan = plan_for(model, inputs, budget="60%")
gm = trace(model, inputs)
# save set: the MLP's c_fc and the attention's c_attn Linear of every recompute region
regions = [Region(r.policy, r.nodes, frozenset(n for n in r.nodes if r.recompute and
                  ("c_fc" in n or "c_attn" in n))) for r in plan.schedule.regions]
sched = Schedule(regions)
print("save sets:", [sorted(r.save) for r in regions])
pm = scheduler.apply(model, sched, inputs)
gen = generate(gm, sched)

# -- the op stream the policy is asked about, eager vs compile --------------------------
seen = {"eager": [], "compile": []}
mode = ["eager"]
orig_policy = cg_mod.save_policy
def recording(ctx, op, *a, **k):
    p = orig_policy(ctx, op, *a, **k)
    if not ctx.is_recompute:
        seen[mode[0]].append((str(op), p == CheckpointPolicy.MUST_SAVE))
    return p
import functools
from torch.utils.checkpoint import create_selective_checkpoint_contexts
cg_mod.SAVE_CONTEXT = functools.partial(create_selective_checkpoint_contexts, recording,
                                        allow_cache_entry_mutation=True)

torch.manual_seed(1); l0, g0 = grads(model, inputs, params)
torch.manual_seed(1); l1, g1 = grads(pm, inputs, params)
seen["eager"].clear()
torch.manual_seed(1); l2, g2 = grads(gen, inputs, params)
eq = torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
print(f"eager (dropout {dropout}): generated vs plan.module bitwise: {eq}; vs model close:",
      all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(g0, g2)))
mode[0] = "compile"
dynamo.reset()
if dropout:
    iconfig.fallback_random = True  # eager RNG in inductor, so masks compare with eager
c = torch.compile(gen, fullgraph=True)
torch.manual_seed(1); l3, g3 = grads(c, inputs, params)
try:
    torch.testing.assert_close(l3, l0); torch.testing.assert_close(g3, g0)
    print("compiled fullgraph: loss and grads close to the model")
except AssertionError as e:
    print("compiled fullgraph: MISMATCH vs model:", str(e).splitlines()[:3])
print("compiled:", saved_summary(SAVED[-1]))
print("  MUST_SAVE saved inside regions:", [(n, s) for n, s, b, t in SAVED[-1] if t == CheckpointPolicy.MUST_SAVE])
e, k = seen["eager"], seen["compile"]
print(f"policy calls (forward): eager {len(e)}, compile {len(k)}; MUST_SAVE eager {sum(x[1] for x in e)}, compile {sum(x[1] for x in k)}")
print("  same op stream:", [x[0] for x in e] == [x[0] for x in k])
if [x[0] for x in e] != [x[0] for x in k]:
    ce, ck = Counter(x[0] for x in e), Counter(x[0] for x in k)
    print("  eager-only:", dict(ce - ck)); print("  compile-only:", dict(ck - ce))
print("  MUST_SAVE ops eager:", dict(Counter(x[0] for x in e if x[1])))
print("  MUST_SAVE ops compile:", dict(Counter(x[0] for x in k if x[1])))

BASE = base_bytes(model, inputs)
def peak(m):
    def f():
        for p in params: p.grad = None
        m(*inputs).backward()
    f()
    return BASE + peak_profiler(f)
for name, m in [("model", model), ("plain plan.module", plan.module), ("save-set plan.module", pm),
                ("save-set generated eager", gen), ("save-set generated compiled", c)]:
    print(f"peak {name:30s} {peak(m)/2**20:.3f} MiB")
