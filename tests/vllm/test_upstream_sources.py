"""tests/support/upstream.py reads vLLM's files out of the source distribution, never the wheel (issue 29).

A fake source archive in a private cache folder stands in for the registry's: ``_download`` finds it
there and never asks the network, so these tests pin the reading, not the fetching.
"""

from __future__ import annotations

import io
import pathlib
import tarfile

import pytest
from support import upstream

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEDGER_UPSTREAM_CACHE", str(tmp_path))
    with tarfile.open(tmp_path / "vllm-9.9.9.tar.gz", "w:gz") as tar:
        for name, text in {"vllm-9.9.9/vllm/v1/core/block_pool.py": "class BlockPool: ...\n",
                           "vllm-9.9.9/requirements/common.txt": "numpy\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return tmp_path


def test_source_file_extracts_one_member_of_the_sdist_into_a_cache_of_files(cache):
    path = upstream.source_file("vllm/v1/core/block_pool.py", "9.9.9")
    assert path == cache / "vllm-9.9.9-sdist-files" / "vllm" / "v1" / "core" / "block_pool.py"
    assert path.read_text() == "class BlockPool: ...\n"
    (cache / "vllm-9.9.9.tar.gz").unlink()  # a second read is served by the cache of files alone
    assert upstream.source_file("vllm/v1/core/block_pool.py", "9.9.9").read_text() == "class BlockPool: ...\n"


def test_source_file_reads_the_unpacked_sdist_when_there_is_one(cache):
    root = upstream.sdist_dir("9.9.9")
    assert upstream.source_file("requirements/common.txt", "9.9.9") == root / "requirements" / "common.txt"
    assert not (cache / "vllm-9.9.9-sdist-files").exists()


@pytest.mark.parametrize("unpacked", [False, True])
def test_a_member_the_sdist_lacks_is_a_file_not_found(cache, unpacked):
    if unpacked:
        upstream.sdist_dir("9.9.9")
    with pytest.raises(FileNotFoundError, match="vllm/nope.py is not in vLLM 9.9.9's source distribution"):
        upstream.source_file("vllm/nope.py", "9.9.9")


def test_no_test_or_bench_reads_the_wheel():
    """The wheel (240-340 MB) is for installing vLLM into the conformance venv only."""
    readers = [str(p.relative_to(ROOT)) for folder in ("tests", "bench", "examples")
               for p in (ROOT / folder).rglob("*.py")
               if "wheel_path(" in p.read_text() and p.name not in ("upstream.py", "test_upstream_sources.py")]
    assert readers == []
    assert not hasattr(upstream, "wheel_file")
