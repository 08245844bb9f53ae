"""The torch-free data at the core: `CostGraph` (what one training step costs, node by node)
and `Schedule` (which regions of it are recomputed). Nothing here imports torch."""
