"""core/hashing.py: the chained block hashes kvledger offers callers without their own.

Pins the documented algorithm so it cannot drift (golden hashes, and the module
docstring's recipe re-implemented here with a hand-written MessagePack encoder),
the chaining (a block's hash covers everything before it), extra keys, that a
partial last block is not hashed, that bad input raises ``InvalidArgumentError``,
and that a fresh process with another ``PYTHONHASHSEED`` computes the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from kvledger import Geometry, InvalidArgumentError, Ledger
from kvledger.core.hashing import HASH_BYTES, block_hash, block_hashes

# --------------------------------------------------------------------------- the documented recipe


def _mp(x) -> bytes:
    """MessagePack of None, int, str, bytes and lists, written from the format's spec
    (not msgspec): the smallest encoding of each value, as every msgpack encoder emits."""
    if x is None:
        return b"\xc0"
    if isinstance(x, bool):
        return b"\xc3" if x else b"\xc2"
    if isinstance(x, int):
        if 0 <= x < 0x80:
            return bytes([x])
        if -32 <= x < 0:
            return struct.pack(">b", x)
        if 0 <= x < 1 << 8:
            return b"\xcc" + struct.pack(">B", x)
        if 0 <= x < 1 << 16:
            return b"\xcd" + struct.pack(">H", x)
        if 0 <= x < 1 << 32:
            return b"\xce" + struct.pack(">I", x)
        if 0 <= x < 1 << 64:
            return b"\xcf" + struct.pack(">Q", x)
        if x >= -(1 << 7):
            return b"\xd0" + struct.pack(">b", x)
        if x >= -(1 << 15):
            return b"\xd1" + struct.pack(">h", x)
        if x >= -(1 << 31):
            return b"\xd2" + struct.pack(">i", x)
        return b"\xd3" + struct.pack(">q", x)
    if isinstance(x, str):
        raw = x.encode()
        assert len(raw) < 32
        return bytes([0xA0 | len(raw)]) + raw
    if isinstance(x, bytes):
        assert len(x) < 256
        return b"\xc4" + bytes([len(x)]) + x
    if isinstance(x, list):
        assert len(x) < 16
        return bytes([0x90 | len(x)]) + b"".join(_mp(v) for v in x)
    raise TypeError(x)


def _recipe(parent, tokens, extra) -> bytes:
    """H(parent, block, extra) = BLAKE2b-128(person=b"kvledger.block1", msgpack([parent, block, extra]))."""
    data = _mp([parent, list(tokens), list(extra)])
    return hashlib.blake2b(data, digest_size=16, person=b"kvledger.block1").digest()


def _chain(tokens, page_tokens, parent=None, extra=()):
    out, h = [], parent
    for i in range(len(tokens) // page_tokens):
        h = _recipe(h, tokens[i * page_tokens : (i + 1) * page_tokens], extra)
        out.append(h)
    return out


# --------------------------------------------------------------------------- golden hashes

GOLDEN = [
    # (id, token_ids, page_tokens, parent, extra_keys, expected hex of each block)
    ("two-blocks-from-the-start", list(range(8)), 4, None, (),
     ["ee2949d91a6464c9a7463c8d07ae14d9", "f98a6ccf71474d18497d11e6c4c6b7d5"]),
    ("int-parent", list(range(8)), 4, 7, (),
     ["2f0430db77e0db9fed33ae661973f9ae", "a22c57ffcaeb8d3dddf84ef2dae92d1d"]),
    ("bytes-parent-and-extra-keys", [5, 6, 7, 8, 9, 10], 3, bytes(range(16)), ("lora-a", 7, b"salt"),
     ["126e400681704e837ee96534116ad7f6", "cb1d361b981525f2d9d804c6a49c5162"]),
]


@pytest.mark.parametrize("tokens,page_tokens,parent,extra,expected", [g[1:] for g in GOLDEN],
                         ids=[g[0] for g in GOLDEN])
def test_golden_hashes(tokens, page_tokens, parent, extra, expected):
    got = block_hashes(tokens, page_tokens, parent=parent, extra_keys=extra)
    assert [h.hex() for h in got] == expected
    assert all(type(h) is bytes and len(h) == HASH_BYTES == 16 for h in got)


@pytest.mark.parametrize("tokens,page_tokens,parent,extra", [
    (list(range(8)), 4, None, ()),
    ([0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 63) - 1], 5, None, ()),
    ([-1, -32, -33, -128, -129, -32768, -32769, -(1 << 31) - 1, -(1 << 63)], 3, 12345, ("x",)),
    ([1, 2, 3, 4], 2, -7, (b"", "", 0)),
    (list(range(100, 130)), 10, bytes(64), ("tenant-42", b"\x00\xff", -5, 1 << 40)),
], ids=["small", "unsigned-widths", "signed-widths", "empty-extra-values", "long-parent"])
def test_hashes_follow_the_documented_recipe(tokens, page_tokens, parent, extra):
    """The module docstring's recipe, re-implemented with a hand-written msgpack encoder,
    gives the same bytes for every integer width and key type msgpack distinguishes."""
    got = block_hashes(tokens, page_tokens, parent=parent, extra_keys=extra)
    assert got == _chain(tokens, page_tokens, parent, extra)
    assert block_hash(parent, tokens[:page_tokens], extra) == _recipe(parent, tokens[:page_tokens], extra)


# --------------------------------------------------------------------------- chaining, extra keys, partial blocks

def test_a_changed_early_token_changes_every_later_hash():
    tokens = list(range(40))
    base = block_hashes(tokens, 8)
    assert len(base) == 5 and len(set(base)) == 5
    for i in (0, 7, 8, 20, 39):
        changed = list(tokens)
        changed[i] += 1000
        got = block_hashes(changed, 8)
        first = i // 8
        assert got[:first] == base[:first]  # blocks before the change are shared
        assert all(a != b for a, b in zip(got[first:], base[first:], strict=True)), i


def test_each_hash_is_its_blocks_hash_under_the_previous_one():
    tokens = list(range(12))
    h = block_hashes(tokens, 4)
    assert h[0] == block_hash(None, tokens[0:4])
    assert h[1] == block_hash(h[0], tokens[4:8])
    assert h[2] == block_hash(h[1], tokens[8:12])
    # a continuation hashed on its own, with the prefix's last hash as parent, is the same chain
    assert block_hashes(tokens[4:], 4, parent=h[0]) == h[1:]


def test_parent_changes_every_hash():
    tokens = list(range(8))
    a, b, c = block_hashes(tokens, 4), block_hashes(tokens, 4, parent=1), block_hashes(tokens, 4, parent=b"\x01")
    assert len({a[0], b[0], c[0]}) == 3 and len({a[1], b[1], c[1]}) == 3


def test_extra_keys_must_all_match():
    tokens = list(range(8))
    plain = block_hashes(tokens, 4)
    lora = block_hashes(tokens, 4, extra_keys=("lora-a",))
    assert block_hashes(tokens, 4, extra_keys=["lora-a"]) == lora  # any sequence
    others = [
        block_hashes(tokens, 4, extra_keys=("lora-b",)),
        block_hashes(tokens, 4, extra_keys=("lora-a", "salt")),
        block_hashes(tokens, 4, extra_keys=("salt", "lora-a")),  # order matters
        block_hashes(tokens, 4, extra_keys=(b"lora-a",)),  # bytes are not str
        block_hashes(tokens, 4, extra_keys=(1,)),
    ]
    firsts = [plain[0], lora[0]] + [o[0] for o in others]
    seconds = [plain[1], lora[1]] + [o[1] for o in others]
    assert len(set(firsts)) == len(firsts) and len(set(seconds)) == len(seconds)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 7, 8, 11])
def test_only_full_blocks_are_hashed(n):
    tokens = list(range(n))
    got = block_hashes(tokens, 4)
    assert len(got) == n // 4
    assert got == block_hashes(tokens[: 4 * (n // 4)], 4)  # a partial last block adds nothing


def test_token_sequences_and_iterables_are_accepted():
    assert block_hashes(tuple(range(8)), 4) == block_hashes(list(range(8)), 4) == block_hashes(range(8), 4)


# --------------------------------------------------------------------------- bad input

BAD = [
    ("page-tokens-zero", lambda: block_hashes([1, 2], 0), ["0"]),
    ("page-tokens-negative", lambda: block_hashes([1, 2], -4), ["-4"]),
    ("page-tokens-float", lambda: block_hashes([1, 2], 2.0), ["2.0"]),
    ("page-tokens-bool", lambda: block_hashes([1, 2], True), ["True"]),
    ("page-tokens-str", lambda: block_hashes([1, 2], "2"), ["'2'"]),
    ("token-str", lambda: block_hashes([1, "2"], 2), []),
    ("token-float", lambda: block_hashes([1, 2.0], 2), []),
    ("token-bool", lambda: block_hashes([1, True], 2), []),
    ("token-none", lambda: block_hashes([None, 1], 2), []),
    ("token-too-large", lambda: block_hashes([1 << 64, 1], 2), []),
    ("token-too-small", lambda: block_hashes([-(1 << 63) - 1, 1], 2), []),
    ("extra-float", lambda: block_hashes([1, 2], 2, extra_keys=(1.5,)), ["1.5"]),
    ("extra-none", lambda: block_hashes([1, 2], 2, extra_keys=(None,)), ["None"]),
    ("extra-bool", lambda: block_hashes([1, 2], 2, extra_keys=(True,)), ["True"]),
    ("extra-list", lambda: block_hashes([1, 2], 2, extra_keys=([1],)), ["[1]"]),
    ("block-hash-token-too-large", lambda: block_hash(None, [1 << 64]), []),
]


@pytest.mark.parametrize("call,names", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_invalid_argument(call, names):
    with pytest.raises(InvalidArgumentError) as ei:
        call()
    for name in names:
        assert name in str(ei.value), (name, str(ei.value))


@pytest.mark.parametrize("parent", [1.5, "ab", [1], True, bytearray(b"ab")],
                         ids=["float", "str", "list", "bool", "bytearray"])
def test_bad_parent_raises_invalid_argument(parent):
    with pytest.raises(InvalidArgumentError, match="parent hash") as ei:
        block_hashes([1, 2], 2, parent=parent)
    assert repr(parent) in str(ei.value)


@pytest.mark.parametrize("parent", [None, 0, -(1 << 63), (1 << 63) - 1, b"\x00", bytes(64)],
                         ids=["none", "zero", "int-min", "int-max", "one-byte", "64-bytes"])
def test_every_documented_parent_is_accepted(parent):
    assert block_hashes([1, 2], 2, parent=parent) == [block_hash(parent, [1, 2])]


@pytest.mark.parametrize("args", [(1.5, [1]), ("ab", [1]), (True, [1]), (None, [1.0]), (None, [True]),
                                  (None, [1], (1.5,))],
                         ids=["float-parent", "str-parent", "bool-parent", "float-token", "bool-token", "float-extra"])
def test_block_hash_checks_its_arguments_as_block_hashes_does(args):
    with pytest.raises(InvalidArgumentError):
        block_hash(*args)


# --------------------------------------------------------------------------- any process, any hash seed

_CHILD = """
import json, sys
from kvledger.core.hashing import block_hashes
cases = json.loads(sys.argv[1])
out = []
for tokens, page_tokens, parent, extra in cases:
    parent = bytes.fromhex(parent[1]) if isinstance(parent, list) else parent
    out.append([h.hex() for h in block_hashes(tokens, page_tokens, parent=parent, extra_keys=extra)])
print(json.dumps(out))
"""

_CASES = [
    (list(range(32)), 8, None, ["tenant-a", "lora:sql", 3]),
    ([9] * 12, 4, 77, []),
    (list(range(1000, 1016)), 16, ["hex", "00ff" * 8], ["salt"]),
]


def _in_this_process():
    out = []
    for tokens, page_tokens, parent, extra in _CASES:
        p = bytes.fromhex(parent[1]) if isinstance(parent, list) else parent
        out.append([h.hex() for h in block_hashes(tokens, page_tokens, parent=p, extra_keys=extra)])
    return out


@pytest.mark.parametrize("seed", ["0", "1", "4242"])
def test_same_hashes_in_a_fresh_process_with_another_hash_seed(seed):
    env = dict(os.environ, PYTHONHASHSEED=seed)
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(_CASES)], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    child = json.loads(done.stdout)
    assert child == _in_this_process()
    assert sum(len(x) for x in child) == 4 + 3 + 1


# --------------------------------------------------------------------------- with the ledger

def test_helper_hashes_publish_and_look_up():
    """The helper's bytes are valid block hashes for ``publish`` / ``lookup`` / ``share``:
    a second prompt with the same first 8 tokens finds exactly one cached block."""
    L = Ledger(Geometry(num_pages=8, page_tokens=4), check=True)
    prompt = list(range(12))
    hashes = block_hashes(prompt, 4)
    L.reserve(1, 3)
    L.commit(1, 0, 3)
    L.seal_step(0)
    L.complete_step(0, 0)
    assert L.publish(1, hashes, prompt) == L.kv_pages(1)
    L.finish(1)
    other = prompt[:4] + [99] + prompt[5:]
    assert L.lookup(block_hashes(other, 4)) == 1
    assert L.lookup(block_hashes(prompt + [1, 2], 4)) == 3
    assert L.share(2, block_hashes(other, 4)[:1]) == L.kv_pages(2) == (L.state.hash_page[hashes[0]],)


# --------------------------------------------------------------------------- the u64 form (issue #19)


def _vllm_fold():
    """``maybe_convert_block_hash`` from vLLM 0.33.0's source distribution (``vllm/v1/core/kv_cache_utils.py``), the
    function's own source run with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` at its default (on)."""
    import ast
    from types import SimpleNamespace

    from support.upstream import UpstreamUnavailable, source_file

    try:
        path = source_file("vllm/v1/core/kv_cache_utils.py")
    except UpstreamUnavailable as exc:
        import warnings

        msg = f"vLLM 0.33.0's kv_cache_utils.py could not be fetched ({exc}): the fold was NOT checked against it"
        warnings.warn(msg, stacklevel=1)
        pytest.skip(msg)
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "maybe_convert_block_hash")
    space = {"envs": SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True), "BlockHash": bytes,
             "ExternalBlockHash": bytes | int}
    exec(compile(ast.Module([fn], []), str(path), "exec"), space)  # noqa: S102
    return space["maybe_convert_block_hash"]


def test_the_u64_form_is_vllms_fold_of_a_wider_hash():
    from kvledger.core.hashing import U64_MASK, to_u64, to_u64_all

    vllm_fold = _vllm_fold()
    rng = __import__("random").Random(3)
    wide = [rng.randbytes(n) for n in (16, 16, 32, 8, 9, 64, 1, 3)] + block_hashes(list(range(64)), 16)
    assert [to_u64(h) for h in wide] == [vllm_fold(h) for h in wide] == list(to_u64_all(wide))
    assert all(0 <= to_u64(h) <= U64_MASK for h in wide)
    assert to_u64(-1) == U64_MASK and to_u64(5) == 5 and to_u64_all([-2, 7]) == (U64_MASK - 1, 7)
    for bad in ("ab", 1.5, None, True):
        with pytest.raises(InvalidArgumentError):
            to_u64(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        to_u64_all([b"a" * 16, "x"])  # type: ignore[list-item]
