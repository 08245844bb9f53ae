"""Capturing a model: `trace` (model + loss into one FX graph), `program` (running that graph
node by node) and `profile` (one recorded step into a `CostGraph`)."""
