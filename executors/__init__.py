"""kvledger.executors: per-rank executors and the clear backends they drive.

    backend.py        the ClearBackend protocol, the lazy registry (make_backend:
                      "torch", "cuda", "triton"), check_page_ids
    executor.py       RankExecutor: per step plan, on the rank's model stream,
                      input copies -> clears -> the step graph; one answer per plan
    torch_backend.py  the torch backend: any torch device, the CPU by default

Importing this package imports neither torch, triton nor CUDA: backends are
imported when one is made.
"""
