"""`radixlora serve`: the HTTP api (http/), the child processes and their supervision (procs/),
and what they share: ServerArgs, the typed messages and the ZeroMQ plumbing."""
