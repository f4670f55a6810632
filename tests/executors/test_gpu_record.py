"""``bench/bench_gpu_record.py``: the GPU runs on record in bench/README.md, per card (no GPU needed)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("bench_gpu_record", ROOT / "bench" / "bench_gpu_record.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


README = """text before
```gpu-record
card: NVIDIA H100 80GB HBM3
date: 2026-12-01
commit: aaa
p128_n16_sc_triton_device_us: 20.00
```
```gpu-record
card: NVIDIA H200
date: 2026-12-05
commit: bbb
p128_n16_sc_triton_device_us: 9.00
```
```gpu-record
card: NVIDIA H100 80GB HBM3
date: 2026-12-06
commit: ccc
p128_n16_sc_triton_device_us: 14.00
overhead_minus_bare_us: 40.00
```
"""


def test_the_last_record_of_the_same_card_is_the_one_compared(tmp_path, capsys):
    mod = _module()
    assert mod.last_on("NVIDIA H100 80GB HBM3", README)["commit"] == "ccc"
    assert mod.last_on("NVIDIA H200", README)["figures"] == {"p128_n16_sc_triton_device_us": 9.0}
    assert mod.last_on("NVIDIA A100", README) is None
    readme = tmp_path / "README.md"
    readme.write_text(README)
    out = tmp_path / "out"
    out.mkdir()
    figures = {"card": "NVIDIA H100 80GB HBM3", "p128_n16_sc_triton_device_us": 12.6, "unrelated": 1.0}
    (out / "bench_gpu.json").write_text(json.dumps(figures))
    (out / "bench_steps_cuda.json").write_text(json.dumps({"card": "NVIDIA H100 80GB HBM3",
                                                           "overhead_minus_bare_us": 30.0}))
    assert mod.compare(str(out), str(readme)) == 0
    text = capsys.readouterr().out
    assert "2026-12-06, ccc" in text and "14.00" in text and "12.60" in text and "0.90" in text
    assert "unrelated" not in text
    mod.emit(str(out), "2026-12-07", "ddd", "gpu-check --round")
    block = capsys.readouterr().out
    assert mod.last_on("NVIDIA H100 80GB HBM3", README + block)["commit"] == "ddd"


def test_a_card_with_no_record_is_said_so(tmp_path, capsys):
    mod = _module()
    readme = tmp_path / "README.md"
    readme.write_text(README)
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench_gpu.json").write_text(json.dumps({"card": "NVIDIA B200", "p3_n16_sc_triton_device_us": 3.0}))
    mod.compare(str(out), str(readme))
    assert "no earlier run on NVIDIA B200" in capsys.readouterr().out
