"""Pinned upstream code, fetched from the package registry at test or bench time.

kvledger proves compatibility with the other side's own code (vLLM's KV-event
decoder, its ``BlockPool``, its KV cache manager and its tests), never with a
restatement of it. That code is never committed: this module downloads the
pinned distribution once into a cache folder and reads files out of it.

    source_file("vllm/distributed/kv_events.py")  -> Path of that file, out of the source distribution
    sdist_dir()                                   -> Path of the unpacked source distribution
    wheel_path()                                  -> Path of the whole wheel: only to install vLLM
                                                     into a virtual environment (scripts/vllm-conformance)

Tests and benchmarks read vLLM's files from the source distribution (about 50 MB,
the same Python files as the wheel, plus ``tests/`` and ``requirements/``), never
from the wheel (240-340 MB, mostly compiled kernels): ``source_file`` extracts
one member into a cache of just the files, and reuses the unpacked sdist when
``sdist_dir`` has made it. ``version`` is one of ``VLLM_VERSIONS`` (default
``VLLM_VERSION``).

The cache folder is ``$KVLEDGER_UPSTREAM_CACHE`` or ``~/.cache/kvledger/upstream``.
Every download is checked against the registry's own sha256. A registry that
cannot be reached raises :class:`UpstreamUnavailable` (callers skip, and say so
loudly); anything else that goes wrong (a bad hash, a file missing from the
wheel) is a plain error, because it means the pin or this module is wrong.

Used by ``tests/`` and by ``bench/`` and ``scripts/`` (which put the repository
root on ``sys.path``). Only the standard library: it runs before anything is
installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request

VLLM_VERSION = "0.33.0"
# The versions scripts/vllm-conformance runs vLLM's own tests for, each in its own environment.
VLLM_VERSIONS = ("0.33.0", "0.34.0")
SIMPLE_INDEX = os.environ.get("KVLEDGER_SIMPLE_INDEX", "https://pypi.org/simple")
_TIMEOUT_S = 300


class UpstreamUnavailable(RuntimeError):
    """The package registry could not be reached: the upstream code is not here."""


def cache_dir() -> pathlib.Path:
    root = os.environ.get("KVLEDGER_UPSTREAM_CACHE")
    path = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "kvledger" / "upstream"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _index_files(project: str) -> list[dict]:
    """The registry's file list for ``project`` (PEP 691 JSON simple API)."""
    request = urllib.request.Request(
        f"{SIMPLE_INDEX}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return list(json.load(answer)["files"])
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise UpstreamUnavailable(f"the package index {SIMPLE_INDEX} cannot be reached: {exc}") from exc


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(project: str, filename: str) -> pathlib.Path:
    """``filename`` of ``project`` in the cache, downloaded and hash-checked once."""
    target = cache_dir() / filename
    if target.exists():
        return target
    entry = next((f for f in _index_files(project) if f["filename"] == filename), None)
    if entry is None:
        raise FileNotFoundError(f"{filename} is not on the package index for {project}")
    with tempfile.NamedTemporaryFile(dir=cache_dir(), delete=False, suffix=".part") as part:
        tmp = pathlib.Path(part.name)
        try:
            with urllib.request.urlopen(entry["url"], timeout=_TIMEOUT_S) as answer:
                shutil.copyfileobj(answer, part, 1 << 20)
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            tmp.unlink(missing_ok=True)
            raise UpstreamUnavailable(f"downloading {filename} failed: {exc}") from exc
    want = entry.get("hashes", {}).get("sha256")
    if want and _sha256(tmp) != want:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{filename}: sha256 does not match the index's {want}")
    tmp.replace(target)
    return target


def _wheel_name(version: str) -> str:
    return f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"


def wheel_path(version: str = VLLM_VERSION) -> pathlib.Path:
    """vLLM's wheel (the x86-64 one), to install vLLM into a virtual environment with ``--no-deps``.
    Never read files out of it: ``source_file`` does that from the source distribution."""
    return _download("vllm", _wheel_name(version))


def source_file(member: str, version: str = VLLM_VERSION) -> pathlib.Path:
    """One file of vLLM's source distribution, e.g. ``vllm/distributed/kv_events.py``.

    The unpacked sdist's copy when ``sdist_dir(version)`` has made it; else the member
    alone, extracted from the source archive into ``vllm-<version>-sdist-files/``.
    Raises ``FileNotFoundError`` for a member the sdist lacks."""
    unpacked = cache_dir() / f"vllm-{version}-sdist"
    if (unpacked / ".complete").exists():
        path = unpacked / f"vllm-{version}" / member
        if not path.is_file():
            raise FileNotFoundError(f"{member} is not in vLLM {version}'s source distribution")
        return path
    target = cache_dir() / f"vllm-{version}-sdist-files" / member
    if target.exists():
        return target
    archive = _download("vllm", f"vllm-{version}.tar.gz")
    with tarfile.open(archive) as tar:
        try:
            data = tar.extractfile(f"vllm-{version}/{member}")
        except KeyError:
            data = None
        if data is None:
            raise FileNotFoundError(f"{member} is not in vLLM {version}'s source distribution")
        content = data.read()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".part")
    tmp.write_bytes(content)
    tmp.replace(target)
    return target


def sdist_dir(version: str = VLLM_VERSION) -> pathlib.Path:
    """vLLM's source distribution, unpacked (it holds ``tests/``, which the wheel lacks)."""
    target = cache_dir() / f"vllm-{version}-sdist"
    done = target / ".complete"
    if done.exists():
        return target / f"vllm-{version}"
    archive = _download("vllm", f"vllm-{version}.tar.gz")
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    done.write_text(version)
    return target / f"vllm-{version}"
