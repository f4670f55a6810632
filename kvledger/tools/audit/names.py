"""The engine's names of ledger requests in an audit's rows: their labels and tenants.

A vLLM run records each hold (a ledger request) with its KV cache group as the
tenant and the vLLM request id as its label (``RequestLabelled``), so a page's
timeline can say which group held a block and for which request:

    kv(17)   ─►  kv(17 req-8 [g1:mamba])        kv({3,5})  ─►  kv({3 a [g0],5 b [g0]})

Requests without a label (every log not written by an engine that names them) read
as before. Tenants come from the state (a window
starting at a checkpoint knows them); labels from the events the audit reads (such a
window knows the labels recorded since its checkpoint).
"""

from __future__ import annotations

import re

from kvledger.core.events.events import RequestLabelled

__all__ = ["HolderNames"]

_HOLDER = re.compile(r"\b(reserved|kv)\((\{?)([0-9,]+)(\}?)\)")


class HolderNames:
    """Labels and tenants of the requests seen so far (seeded from a state's live requests)."""

    def __init__(self, st=None) -> None:
        self.labels: dict[int, str] = {}
        self.tenants: dict[int, str] = {}
        if st is not None:
            for r, rec in st.requests.items():
                if rec.tenant is not None:
                    self.tenants[r] = rec.tenant

    def event(self, ev, t, st) -> None:
        """Learn from an event, after its fold into ``st`` (call it for every event, before its rows
        are made): a label, or the tenant of the request it names as the state now records it."""
        if t is RequestLabelled:
            self.labels[ev.request] = ev.label
            return
        r = getattr(ev, "request", None)
        if r is not None:
            rec = st.requests.get(r)
            if rec is not None and rec.tenant is not None:
                self.tenants[r] = rec.tenant

    def name(self, r: int) -> str:
        """``r``, with its label and tenant when it has a label."""
        label = self.labels.get(r)
        if label is None:
            return str(r)
        tenant = self.tenants.get(r)
        return f"{r} {label}" + (f" [{tenant}]" if tenant is not None else "")

    def decorate(self, text: str) -> str:
        """``text`` (a holder as ``LedgerState.holder_of`` writes it) with each labelled request named."""
        if not self.labels or "(" not in text:
            return text

        def sub(m: re.Match) -> str:
            ids = ",".join(self.name(int(r)) for r in m.group(3).split(","))
            return f"{m.group(1)}({m.group(2)}{ids}{m.group(4)})"

        return _HOLDER.sub(sub, text)
