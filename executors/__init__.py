"""kvledger.executors: per-rank executors and the clear backends they drive.

    backend.py         the ClearBackend protocol and the lazy registry (make_backend:
                       "bytes", "torch", "cuda", "triton"; default_backend); coalesce_runs
    bytes_backend.py   the bytes backend: planes that are plain byte buffers, on the host,
                       no torch (byte_plane makes one)
    executor.py        RankExecutor: per step plan, on the rank's model stream,
                       input copies -> clears -> the step graph; one answer per plan
    torch_backend.py   the torch backend: any torch device, the CPU by default
    cuda_backend.py    the cuda backend: cuMemsetD8Async per run of adjacent pages
    cuda_planes.py     what the CUDA backends share: planes described once, a stream's handle
    triton_backend.py  the triton backend: one kernel launch for all pages and planes,
                       capturable in a CUDA graph
    cuda_driver.py     the one adapter to the CUDA driver API (checks every result)
    vmm.py             cache planes on CUDA virtual memory, with aliasing snapshot rows

Page ids are checked by ``kvledger.core.checks.page_ids``; plans are
``kvledger.core.events.StepPlan``. Importing this package, ``backend`` or
``executor`` imports neither torch, triton nor CUDA: backends are imported when
one is made.
"""
