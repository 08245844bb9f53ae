"""The cost model: `simulate(graph, schedule) -> Estimate`, the one source of predicted peak
memory and time, and the static analyses the solvers share with it."""
