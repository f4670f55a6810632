"""``kvledger demo --sanitize``: the run under pressure in the engine's sanitizer mode.

``--no-clear``'s backend poisons and checks like a real one and only skips the zeroing
(checked here through a real ``RankExecutor(sanitize=True)``). Without the engine's
sanitizer (``open_engine(..., sanitize=True)``) the flag is refused with a clear error,
before any log exists; with it, clears on find nothing and the logits equal the
reference, and ``--no-clear`` is stopped at the first step that lists a page it did not
zero, before any request reads it (no INVALID_SPECULATION). Budget: about 10 s.
"""

from __future__ import annotations

import dataclasses

import anyio
import pytest

torch = pytest.importorskip("torch")

from support.demo import simulate_demo  # noqa: E402

from kvledger.core.errors import ConfigurationError, InvariantViolation  # noqa: E402
from kvledger.core.events import StepPlan  # noqa: E402
from kvledger.demo import DemoConfig  # noqa: E402
from kvledger.demo import sanitize as sanitize_mod  # noqa: E402
from kvledger.demo.cli import main  # noqa: E402
from kvledger.demo.ranks import SkipClearBackend  # noqa: E402
from kvledger.demo.results import compare_logits  # noqa: E402
from kvledger.executors.executor import RankExecutor, StepInputs, StepJob, StepReplies  # noqa: E402
from kvledger.executors.sanitize import NOT_ZERO, POISON, Violation  # noqa: E402
from kvledger.executors.torch_backend import TorchClearBackend  # noqa: E402

SMALL = DemoConfig(requests=12, short_tokens=128, long_tokens=256, bare_every=0, sanitize=True)
needs_sanitizer = pytest.mark.skipif(not sanitize_mod.has_sanitizer(),
                                     reason="this kvledger's open_engine has no sanitize=True")


def _job(step, clear_list, poison=(), committed=()):
    return StepJob(StepPlan(step=step, clear_list=tuple(clear_list)), StepInputs(), anyio.CancelScope(),
                   StepReplies(1), poison=poison, committed=committed)


@pytest.mark.parametrize("skip", [False, True])
def test_no_clear_backend_poisons_and_checks_but_never_zeroes(skip):
    """Page 3 holds stale bytes, page 5 is poisoned: both listed and page 5 committed. The
    torch backend zeroes both (nothing found); SkipClearBackend zeroes neither, so the check
    names both pages in every plane, and page 5's poison, and the graph never runs."""
    planes = [torch.zeros(8, 4, 2, 8, dtype=torch.float8_e4m3fn) for _ in range(2)]
    for p in planes:
        p.view(torch.uint8)[3] = 0x42
    backend = SkipClearBackend(planes) if skip else TorchClearBackend(planes)
    ran = []
    ex = RankExecutor(0, num_pages=8, backend=backend, planes=planes, sanitize=True,
                      graph=lambda ctx, step, inputs: ran.append(step))

    async def go():
        return await ex.run_job(_job(0, [3, 5], poison=[5], committed=[5]))

    out = anyio.run(go)
    if not skip:
        assert out.status == "ok" and ran == [0] and out.timing.sanitize_s > 0
        assert all(int(p.view(torch.uint8)[[3, 5]].abs().sum()) == 0 for p in planes)
        return
    assert out.status == "failed" and isinstance(out.error, InvariantViolation) and ran == []
    want = [Violation(plane=i, page=3, kind=NOT_ZERO) for i in range(2)]
    want += [Violation(plane=i, page=5, kind=k) for i in range(2) for k in (NOT_ZERO, POISON)]
    assert out.violations == tuple(sorted(want))
    assert bool((planes[0].view(torch.uint8)[5] == 0xFF).all()) and backend.pages_skipped == 2


def test_sanitize_is_refused_clearly_without_the_engines_sanitizer(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sanitize_mod, "has_sanitizer", lambda: False)
    with pytest.raises(ConfigurationError, match="needs the engine's sanitizer"):
        simulate_demo(SMALL)
    log = tmp_path / "s.kvlog"
    argv = ["--requests", "4", "--prompt-tokens", "128,256", "--sanitize", "--no-progress", "--log", str(log)]
    assert main(argv) == 2
    assert "needs the engine's sanitizer" in capsys.readouterr().err and not log.exists()
    # without --sanitize nothing asks for it; the reference never does
    assert sanitize_mod.engine_options(dataclasses.replace(SMALL, sanitize=False), False) == {}
    assert sanitize_mod.engine_options(SMALL, True) == {}
    with pytest.raises(Exception, match="sanitize must be True or False"):
        dataclasses.replace(SMALL, sanitize=1).validate()


@needs_sanitizer
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_clears_on_the_sanitizer_finds_nothing(prefix_cache):
    cfg = dataclasses.replace(SMALL, prefix_cache=prefix_cache)
    run, ref = simulate_demo(cfg), simulate_demo(cfg, reference=True)
    assert run.sanitizer_violations == run.sanitizer_steps == 0 and not run.sanitizer_first
    assert run.passed == 12 and run.pages_zeroed == run.pages_listed > 0 and compare_logits(run, ref)["equal"]
    assert run.sanitize_sum_s > 0 and ref.sanitize_sum_s == 0  # the check ran; the reference is plain


@needs_sanitizer
def test_no_clear_is_stopped_before_any_request_reads_a_stale_byte():
    off = simulate_demo(dataclasses.replace(SMALL, clear=False))
    assert off.sanitizer_violations > 0 and off.sanitizer_steps > 0
    assert off.invalid_speculation == 0  # stopped before the graph: nothing decoded a stale NaN
    assert off.passed + off.sanitizer_stopped == 12 and off.snapshots_made == (
        off.snapshots_released + off.snapshots_dropped)
    head = off.sanitizer_first.splitlines()[0]
    assert head.startswith("step ") and "rank 0, plane " in head and "page " in head and "request " in head
    assert "lifecycle of page" in off.sanitizer_first
    again = simulate_demo(dataclasses.replace(SMALL, clear=False))  # deterministic for a fixed seed
    assert (again.sanitizer_first, again.sanitizer_violations, again.digest) == (
        off.sanitizer_first, off.sanitizer_violations, off.digest)
