"""scripts/vllm-conformance pins each vLLM version's environment inside what that version declares.

The script checks the built environment itself (every installed package vLLM's
``requirements/cpu.txt`` names, against its specifier); this pins the same rule on the pin
lists alone, without building anything, so an edit that leaves a declared range fails here
first. Declared requirements come from the version's source distribution
(``tests/support/upstream.py``; skipped, loudly, when the registry cannot be reached).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import pathlib
import warnings

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support import upstream

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _script():
    loader = importlib.machinery.SourceFileLoader("vllm_conformance", str(ROOT / "scripts" / "vllm-conformance"))
    spec = importlib.util.spec_from_loader("vllm_conformance", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _declared(path: pathlib.Path) -> dict[str, Requirement]:
    out: dict[str, Requirement] = {}
    for raw in path.read_text().splitlines():
        line = raw.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            out.update(_declared(path.parent / line[3:].strip()))
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"platform_machine": "x86_64", "platform_system": "Linux",
                                                      "python_version": "3.11", "sys_platform": "linux"}):
            out[canonicalize_name(req.name)] = req
    return out


def test_every_version_has_an_environment():
    script = _script()
    assert tuple(script.VERSIONS) == upstream.VLLM_VERSIONS
    for version in script.VERSIONS:
        names = [script._name(pin) for pin in script.pins(version)]
        assert len(names) == len(set(names)), f"{version}: a package pinned twice"


@pytest.mark.parametrize("version", upstream.VLLM_VERSIONS)
def test_pins_are_inside_the_declared_requirements(version):
    script = _script()
    try:
        cpu_txt = upstream.sdist_dir(version) / "requirements" / "cpu.txt"
    except upstream.UpstreamUnavailable as exc:
        msg = f"vLLM {version}'s sdist could not be fetched ({exc}): its pins were NOT checked"
        warnings.warn(msg, stacklevel=1)
        pytest.skip(msg)
    declared = _declared(cpu_txt)
    outside = []
    for pin in script.pins(version):
        req = Requirement(pin)
        name = canonicalize_name(req.name)
        have = next(iter(req.specifier)).version
        want = declared.get(name)
        if want is not None and (want.url or not want.specifier.contains(have, prereleases=True)):
            outside.append(name)
    assert sorted(outside) == sorted(n for n in script.DEVIATIONS if n in outside) == ["torch"], outside
