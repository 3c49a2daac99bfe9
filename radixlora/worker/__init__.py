"""The worker's side of the ZeroMQ seam: everything that holds device tensors. The model
runner (eager and CUDA-graph steps), attention backends and KV tensors, the adapter pool and
its reads, the sampler, the step executor, kernel compile caches and device sizing."""
