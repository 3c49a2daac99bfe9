"""The scheduler's side of the ZeroMQ seam: request intake, the waiting and running queues, KV
slot and adapter-row bookkeeping, the radix prefix cache, the step loop and structured-output
grammars. Nothing here holds a device tensor: the worker owns every tensor."""
