"""The server's processes and their supervision: the launcher, the tokenizer, scheduler, worker
and registry loops, the data-parallel router and the adapter lifecycle they keep."""
