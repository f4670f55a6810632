"""The sanitizer's device side on CUDA (torch on CUDA, cuda, triton): poison and the check against
the torch reference on random data, the executor naming a skipped plane, a full result buffer."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from support.gpu import as_bytes, gpu_backend, random_planes  # noqa: E402

from kvledger import InvariantViolation, StepPlan  # noqa: E402
from kvledger.executors.sanitize import NOT_ZERO, POISON, TorchVerifier, Violation  # noqa: E402

BACKENDS = ["torch", "cuda", "triton", "triton-staged"]
LAYOUTS = {
    "16k": (40, [(torch.uint8, (16384,)), (torch.float8_e4m3fn, (16384,)), (torch.uint8, (16384,))], 0),
    "fp8-kv-scales": (64, [(torch.float8_e4m3fn, (16, 128)), (torch.float8_e4m3fn, (8, 128)),
                           (torch.bfloat16, (16, 128))], 0),
    "small-odd": (50, [(torch.uint8, (100,)), (torch.float32, (9,))], 0),
    "misaligned": (30, [(torch.uint8, (7,)), (torch.uint8, (13,))], 3),
}


def damage(planes, num_pages, rng):
    for p in planes:
        b = as_bytes(p)
        width = b.shape[1]
        for page in rng.sample(range(num_pages), num_pages // 2):
            at = rng.randrange(0, width, 8) if width >= 8 else 0
            what = rng.randrange(3)
            if what == 0:
                b[page].zero_()
            elif what == 1:
                b[page, at:at + 8] = 255
            else:
                b[page, at:min(width, at + 8) - 1] = 255


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", BACKENDS)
def test_poison_and_check_match_the_torch_reference(name, layout):
    num_pages, specs, offset = LAYOUTS[layout]
    rng = random.Random(f"{name}/{layout}")
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    planes = random_planes(specs, num_pages, offset=offset, lo=0, hi=255, generator=g)
    backend = gpu_backend(name, planes)
    for _ in range(4):  # fresh damage and lists each round
        damage(planes, num_pages, rng)
        cleared = rng.sample(range(num_pages), rng.randrange(num_pages))
        committed = rng.sample(range(num_pages), rng.randrange(num_pages))
        torch.cuda.synchronize()
        want = TorchVerifier([p.cpu() for p in planes]).start(cleared, committed).result()
        assert backend.verify(cleared, committed) == want
        listed = rng.sample(range(num_pages), rng.randrange(1, num_pages))
        expected = [as_bytes(p).cpu() for p in planes]
        for e in expected:
            e[torch.tensor(listed)] = 255
        backend.poison(listed)
        torch.cuda.synchronize()
        for k, (p, e) in enumerate(zip(planes, expected, strict=True)):
            assert torch.equal(as_bytes(p).cpu(), e), f"plane {k}: poison missed or spilled"


def test_more_violations_than_the_buffer_holds_are_counted():
    pytest.importorskip("cuda.bindings")
    pytest.importorskip("triton")
    from kvledger.executors.triton_backend import TritonClearBackend
    from kvledger.executors.triton_verify import MAX_OUT

    num_pages = 512
    planes = [torch.full((num_pages, 256), 7, dtype=torch.uint8, device="cuda") for _ in range(2)]
    check = TritonClearBackend(planes).start_verify(range(num_pages), [])
    found = check.result()
    assert check.total == 2 * num_pages and len(found) == MAX_OUT
    assert all(v.kind == NOT_ZERO for v in found)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["triton", "cuda", "torch"])
async def test_the_executor_names_the_plane_a_backend_skipped(name):
    import anyio

    from kvledger.executors.executor import RankExecutor, StepInputs, StepJob, StepReplies

    num_pages, specs, offset = LAYOUTS["fp8-kv-scales"]
    planes = random_planes(specs, num_pages, offset=offset, lo=0, hi=255, generator=torch.Generator().manual_seed(3))
    s = torch.cuda.Stream()
    full = gpu_backend(name, planes, s)
    partial = gpu_backend(name, [planes[0], planes[2]], s)  # skips plane 1

    class SkipsPlaneOne:
        def __init__(self):
            self.name, self.num_pages = "skips-plane-1", num_pages
            self.poison, self.start_verify = full.poison, full.start_verify
            self.clear = partial.clear

    ran = []
    ex = RankExecutor(0, num_pages=num_pages, backend=SkipsPlaneOne(), planes=planes, device=planes[0].device,
                      stream=s, sanitize=True, graph=lambda ctx, step, inputs: ran.append(step))

    async def run(step, clear_list, poison=(), committed=()):
        j = StepJob(StepPlan(step=step, clear_list=tuple(clear_list)), StepInputs(), anyio.CancelScope(),
                    StepReplies(1), poison=poison, committed=committed)
        return await ex.run_job(j)

    assert (await run(0, [], poison=[5, 6, 40])).status == "ok"
    out = await run(1, [5, 6, 40], committed=[5, 6, 40, 41])
    assert out.status == "failed" and isinstance(out.error, InvariantViolation)
    assert out.violations == tuple(Violation(plane=1, page=p, kind=k) for p in (5, 6, 40) for k in (NOT_ZERO, POISON))
    assert ran == [0]
    assert out.timing is not None and out.timing.sanitize_s > 0 and out.timing.clear_host_s > 0
