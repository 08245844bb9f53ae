"""Running real training steps: live-storage tracking on CPU, the allocator's peak on CUDA,
step times, and the per-part breakdown of a step's peak."""
