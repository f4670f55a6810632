"""A hybrid model under vLLM's own scheduler, byte by byte: what vLLM's zeroing lets through, what
kvledger's ``groups`` policy zeroes instead, and one block's life across the two KV cache groups.

    pip install 'kvledger[vllm]'            # or: python scripts/vllm-conformance (builds a vLLM venv)
    (without vLLM it exits 2, naming that install command)
    python examples/vllm_hybrid.py [--steps 300] [--config align|none|mixed] [--async]

A hybrid model (attention layers and Mamba layers) gets one KV cache whose blocks
both groups use: vLLM lays each Mamba layer's states over an attention layer's
pages. A block freed by one group is handed to the other with whatever bytes it
holds, and a Mamba state is read before it is written. vLLM zeroes every new
attention block and no Mamba block.

This runs ``python -m kvledger.integrations.vllm.probe`` (vLLM's ``Scheduler``
built by vLLM's own test utilities over a config vLLM's code planned, the
workers emulated on tagged CPU tensors, every read classified) twice: with
vLLM's own ``new_block_ids_to_zero``, and with kvledger installed under the
``groups`` policy with ``zeroing=True``. vLLM's test utilities come from its
source distribution (``tests/support/upstream.py``: downloaded once, 47 MB,
cached). Then ``kvledger audit --page`` shows, from the kvledger run's log, a
block going from the attention group to the Mamba group and back: who held it,
when it was marked, when it was zeroed and when a full write made the clear
unnecessary.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
INSTALL = "pip install 'kvledger[vllm]'"


def _vllm_tests() -> pathlib.Path:
    """The folder holding vLLM's ``tests/`` for the installed version (its unpacked sdist)."""
    import vllm

    sys.path.append(str(ROOT))  # (appended: the installed kvledger package stays first)
    from tests.support import upstream

    try:
        return upstream.sdist_dir(vllm.__version__)
    except upstream.UpstreamUnavailable as exc:
        print(f"vllm_hybrid.py needs vLLM {vllm.__version__}'s source distribution (its test utilities), which "
              f"could not be fetched: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _crossing_page(log: str) -> int | None:
    """The first page reserved by a Mamba group's hold after an attention group's held it."""
    from kvledger.core.events.events import PagesReserved
    from kvledger.core.log import open_view

    last: dict[int, str] = {}
    view = open_view(log)
    try:
        for _, ev, _ in view.iter_events():
            if type(ev) is not PagesReserved or ev.tenant is None:
                continue
            kind = ev.tenant.split(":")[1]
            for page in ev.page_ids:
                if kind == "mamba" and last.get(page, "mamba") != "mamba":
                    return page
                last[page] = kind
    finally:
        view.close()
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--config", default="align", choices=["align", "none", "mixed"],
                    help="attention + Mamba (mamba_cache_mode align or none), or fp16 + fp32 attention groups")
    ap.add_argument("--async", dest="async_", action="store_true", help="async scheduling (with dropped work)")
    args = ap.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print(f"vllm_hybrid.py needs vLLM, which is not installed here: {INSTALL}", file=sys.stderr)
        raise SystemExit(2)
    where = _vllm_tests()
    out = pathlib.Path(tempfile.mkdtemp(prefix="kvledger-hybrid-"))
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    probe = [sys.executable, "-m", "kvledger.integrations.vllm.probe", "--steps", str(args.steps),
             "--configs", args.config, "--modes", "async" if args.async_ else "sync", "--rules", "vllm,groups",
             "--json", str(out / "probe.json"), "--log-dir", str(out / "logs")]
    print("$ python -m kvledger.integrations.vllm.probe " + " ".join(probe[3:-4]), flush=True)
    rc = subprocess.run(probe, cwd=where, env=env, check=False).returncode
    if rc != 0:
        raise SystemExit(f"the probe exited {rc}")
    rows = {r["rule"]: r for r in json.loads((out / "probe.json").read_text())}
    log = rows["groups"]["log"]
    page = _crossing_page(log)
    if page is None:
        print("\n(no block went from the attention group to the Mamba group in this trace: try more --steps)")
        return
    from kvledger.tools.cli import main as kvledger_cli

    argv = ["audit", log, "--page", str(page), "--since", "0"]
    print(f"\nblock {page} in the kvledger run's log (every transition: holder, group, mark, clear):")
    print(f"$ kvledger {' '.join(argv).replace(log, 'LOG')}", flush=True)
    raise SystemExit(kvledger_cli(argv))


if __name__ == "__main__":
    main()
