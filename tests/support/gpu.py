"""What the GPU tests share (each skips cleanly without CUDA; importing this imports no torch).

    cuda_available()    whether torch is installed and sees a CUDA device (asked when a test is set up)
    REQUIRES_CUDA       the marks of a module that needs one (``pytestmark = REQUIRES_CUDA``): ``gpu``
                        and the ``needs_cuda`` fixture (tests/conftest.py), which skips naming what is
                        missing
    requires_cuda       the same for one test (a decorator)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

__all__ = ["REQUIRES_CUDA", "cuda_available", "requires_cuda"]

F = TypeVar("F", bound=Callable)


def cuda_available() -> bool:
    """Whether torch is installed here and sees a CUDA device (False without torch)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


REQUIRES_CUDA = [pytest.mark.gpu, pytest.mark.usefixtures("needs_cuda")]


def requires_cuda(fn: F) -> F:
    """Mark one test as needing a CUDA device (``REQUIRES_CUDA``)."""
    for mark in REQUIRES_CUDA:
        fn = mark(fn)
    return fn
