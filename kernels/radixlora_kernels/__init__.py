"""radixlora's Triton kernels: batched LoRA (SGMV shrink / expand, grouped), paged attention
(decode and extend), fused norms, rotary embeddings, activations, sampling, NF4 and FP8 GEMV,
DoRA's scale. Each module has the kernel, its launch wrapper and a pure-torch reference with the
same semantics (the CPU path, and the oracle of the tests under TRITON_INTERPRET=1). Imports
torch and Triton only; without Triton the references still import (triton_compat)."""
