"""The demo's workload: the seed's request trace, scaled, and the knobs of a run.

The seed (helios PR 181): 143 requests alternating 16k/32k-token prompts under a
49.5 GB memory limit, TP2. Here the same shape with sizes that fit a CPU:
143 requests alternating short and long prompts (1024 / 2048 tokens by default),
16-token pages, a few generated tokens each, and a page budget tight enough that
the scheduler keeps evicting snapshot rows to admit requests, so released snapshot
pages come back as requests' partially filled tail pages again and again.

Pure Python (no torch): the CLI parses into a ``DemoConfig`` before torch is loaded.
"""

from __future__ import annotations

import dataclasses

from kvledger.core.errors import ConfigurationError, InvalidArgumentError
from kvledger.core.events import CLEAR_POLICIES

__all__ = ["DemoConfig", "RequestSpec", "requests_of", "INVALID_SPECULATION"]

INVALID_SPECULATION = 6  # the device error the seed's engine reported for non-finite logits


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of the trace: ``prompt_tokens`` tokens in, ``gen_tokens`` tokens out."""

    request: int
    prompt_tokens: int
    gen_tokens: int
    tenant: str

    def kv_tokens(self) -> int:
        """Tokens whose K/V end up in the cache (the last generated token is never fed)."""
        return self.prompt_tokens + self.gen_tokens - 1

    def pages(self, page_tokens: int) -> int:
        """Pages the request holds once it is done."""
        return -(-self.kv_tokens() // page_tokens)

    def prompt_pages(self, page_tokens: int) -> int:
        return -(-self.prompt_tokens // page_tokens)

    def checkpoints(self, every: int, prefix: int = 0) -> tuple[int, ...]:
        """Token counts after which prefill snapshots the recurrent state: every ``every``
        tokens and at the end of the prompt (prefix caching for a hybrid model), and after
        the ``prefix`` tokens of a shared system prompt (``--prefix-cache``; 0: none)."""
        out = tuple(range(every, self.prompt_tokens, every)) + (self.prompt_tokens,)
        if 0 < prefix < self.prompt_tokens and prefix not in out:
            out = tuple(sorted(out + (prefix,)))
        return out


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on. ``validate()`` raises ``InvalidArgumentError``
    / ``ConfigurationError`` naming the bad knob.

    ``prefix_cache=True`` (``--prefix-cache``): every prompt starts with its tenant's
    system prompt of ``system_tokens`` tokens (``None``: half the short prompt); the full
    pages of it are shared between the tenant's requests through the ledger's prefix
    cache (``kvledger.demo.prefix``). ``bare_every``: every this many steps the run
    under pressure also runs the step's graph bare, without the engine, to measure the
    engine's per-step overhead against it (0: never; ``kvledger.demo.bare``).
    ``sanitize=True`` (``--sanitize``): the run under pressure opens the engine with
    ``sanitize=True`` (``kvledger.demo.sanitize``).

    ``page_budget``: pages in the cache under pressure; ``None`` picks one from
    ``pressure`` (the fraction of the pages ``max_running`` average requests would
    hold). ``clear=False`` is the seed's failure: the ledger still lists pages, the
    executors do not zero them. ``keep_going=True`` counts a request's
    INVALID_SPECULATION but lets it decode to the end instead of cancelling it, so a
    run with clears off follows exactly the schedule of one with clears on (the
    scheduler never looks at logits): the fair baseline for step-time comparisons.
    """

    requests: int = 143
    short_tokens: int = 1024
    long_tokens: int = 2048
    gen_tokens: int = 8
    page_tokens: int = 16
    page_budget: int | None = None
    pressure: float = 0.75
    max_running: int = 8
    snapshot_cache: int | None = None  # cap on live snapshots; None: evicted under pressure only
    snapshot_every: int = 512  # prefill snapshots the recurrent state every this many tokens, and at the end
    policy: str = "released_aliases"
    clear: bool = True
    device: str = "cpu"
    backend: str = "torch"
    ranks: int = 1
    seed: int = 0
    layers: int = 2
    heads: int = 4
    head_dim: int = 16
    d_model: int = 64
    tenants: int = 3
    threads: int | None = 1  # torch intra-op threads on the CPU (None: leave torch's setting)
    keep_going: bool = False  # count INVALID_SPECULATION but keep decoding (same schedule either way: timing)
    prefix_cache: bool = False  # tenants' system prompts shared through the ledger's prefix cache
    system_tokens: int | None = None  # system prompt length (None: short_tokens // 2)
    bare_every: int = 8  # run the graph bare (no engine) every this many steps, for the overhead figure; 0: never
    sanitize: bool = False  # the run under pressure in the engine's sanitizer mode (kvledger.demo.sanitize)

    def validate(self) -> DemoConfig:
        for name in ("requests", "short_tokens", "long_tokens", "gen_tokens", "page_tokens", "max_running",
                     "ranks", "layers", "heads", "head_dim", "d_model", "tenants", "snapshot_every"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
        if self.gen_tokens < 2:
            raise InvalidArgumentError(f"gen_tokens must be >= 2 (at least one decode step), got {self.gen_tokens}")
        if self.threads is not None and (type(self.threads) is not int or self.threads < 1):
            raise InvalidArgumentError(f"threads must be a positive int or None, got {self.threads!r}")
        if self.page_budget is not None and (type(self.page_budget) is not int or self.page_budget < 1):
            raise InvalidArgumentError(f"page_budget must be a positive int, got {self.page_budget!r}")
        if not 0.0 < self.pressure <= 4.0:
            raise InvalidArgumentError(f"pressure must be in (0, 4], got {self.pressure!r}")
        if self.snapshot_cache is not None and (type(self.snapshot_cache) is not int or self.snapshot_cache < 0):
            raise InvalidArgumentError(f"snapshot_cache must be an int >= 0, got {self.snapshot_cache!r}")
        if self.policy not in CLEAR_POLICIES:
            raise ConfigurationError(f"unknown clear policy {self.policy!r}; one of {CLEAR_POLICIES}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigurationError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.heads % self.ranks:
            raise ConfigurationError(f"heads ({self.heads}) must divide by ranks ({self.ranks})")
        if type(self.sanitize) is not bool:
            raise InvalidArgumentError(f"sanitize must be True or False, got {self.sanitize!r}")
        if type(self.bare_every) is not int or self.bare_every < 0:
            raise InvalidArgumentError(f"bare_every must be an int >= 0, got {self.bare_every!r}")
        if self.prefix_cache:
            self._validate_prefix()
        return self

    def _validate_prefix(self) -> None:
        sys_tokens = self.system_prompt_tokens()
        if type(sys_tokens) is not int or not self.page_tokens <= sys_tokens < min(self.short_tokens, self.long_tokens):
            raise InvalidArgumentError(
                f"system_tokens must be an int from page_tokens ({self.page_tokens}) to below the shortest prompt "
                f"({min(self.short_tokens, self.long_tokens)}), got {sys_tokens!r}")

    def system_prompt_tokens(self) -> int:
        """Tokens of each tenant's system prompt (``--prefix-cache``)."""
        return self.short_tokens // 2 if self.system_tokens is None else self.system_tokens

    def prefix_tokens(self) -> int:
        """Tokens of the shared prefix: the system prompt's full pages (0 without ``prefix_cache``)."""
        if not self.prefix_cache:
            return 0
        return self.system_prompt_tokens() // self.page_tokens * self.page_tokens

    def specs(self) -> list[RequestSpec]:
        return requests_of(self)

    def budget(self) -> int:
        """The page budget under pressure: ``page_budget``, or ``pressure`` times the
        pages ``max_running`` requests of average size hold (at least the largest
        request plus one snapshot, so the trace always makes progress)."""
        specs = self.specs()
        largest = max(s.pages(self.page_tokens) for s in specs)
        if self.page_budget is not None:
            return self.page_budget
        mean = sum(s.pages(self.page_tokens) for s in specs) / len(specs)
        return max(int(self.pressure * self.max_running * mean), largest + 2 * self.max_running)


def requests_of(config: DemoConfig) -> list[RequestSpec]:
    """The trace: request ``i`` has the short prompt when ``i`` is even, the long one when
    odd (alternating, as in the seed); tenants round-robin."""
    out = []
    for i in range(config.requests):
        tokens = config.short_tokens if i % 2 == 0 else config.long_tokens
        out.append(RequestSpec(request=i, prompt_tokens=tokens, gen_tokens=config.gen_tokens,
                               tenant=f"tenant-{i % config.tenants}"))
    return out
