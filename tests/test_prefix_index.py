"""The prefix-reuse block index (``hisparse.cache.prefix_index``), host-side: chained
block names (prefix property, salt, parent, partial blocks, bad input), longest-prefix
lookup, reference counts, LRU eviction of unreferenced blocks only, reset, and a
randomized trace against a plain model with the index's invariants checked after every
operation."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from hisparse.cache.prefix_index import (
    NAME_BYTES,
    PrefixIndex,
    block_names,
    names_of_bytes,
)


def test_names_chain_over_whole_blocks():
    a = block_names(list(range(10)), 4)
    assert len(a) == 2 and all(len(n) == NAME_BYTES for n in a)  # the partial third block has no name
    b = block_names(list(range(8)) + [99, 98], 4)
    assert b == a  # only whole blocks count
    c = block_names([0, 1, 2, 3, 4, 5, 6, 77], 4)
    assert c[0] == a[0] and c[1] != a[1]
    d = block_names([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert d[0] != a[0] and d[1] != a[1]  # a change before a block renames it (chained)
    assert block_names(list(range(8)), 4, salt=b"model-b") != a[:2]
    assert block_names(list(range(8)), 4, salt=b"x" * 200) != block_names(list(range(8)), 4, salt=b"x" * 199)
    assert block_names(list(range(4, 8)), 4, parent=a[0]) == a[1:2]  # a follow-up after a cached prefix
    assert block_names(np.arange(8, dtype=np.int64), 4) == block_names(list(range(8)), 4)
    assert block_names(tuple(range(8)), 4) == block_names(np.arange(8, dtype=np.uint32), 4)
    assert block_names([], 4) == []


def test_names_of_each_hash():
    toks = list(range(40))
    sha = block_names(toks, 8)
    assert sha == block_names(toks, 8, algo="sha256") and len(sha) == 5
    try:
        import xxhash  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs the xxhash package"):
            block_names(toks, 8, algo="xxh3_128")
    else:
        xx = block_names(toks, 8, algo="xxh3_128")
        assert len(xx) == 5 and all(len(n) == NAME_BYTES for n in xx) and xx != sha
        assert block_names(toks[:16] + [99] * 8, 8, algo="xxh3_128")[:2] == xx[:2]
    with pytest.raises(ValueError, match="algo must be one of"):
        block_names(toks, 8, algo="md5")


def _names_by_definition(toks, B, salt=None, parent=b"", algo="sha256"):
    """h_i = H(h_{i-1} || H(salt) or 16 zero bytes || block i's ids as little-endian uint32)."""
    def H(b):
        if algo == "sha256":
            return hashlib.sha256(b).digest()[:NAME_BYTES]
        import xxhash
        return xxhash.xxh3_128_digest(b)

    salted = H(salt) if salt is not None else bytes(NAME_BYTES)
    h, out = parent or bytes(NAME_BYTES), []
    for i in range(len(toks) // B):
        h = H(h + salted + b"".join(int(t).to_bytes(4, "little") for t in toks[i * B:(i + 1) * B]))
        out.append(h)
    return out


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
@pytest.mark.parametrize("nblocks", [0, 1, 3, 15, 16, 40])  # both sides of the row layout's threshold
def test_names_are_the_definition(algo, nblocks):
    if algo == "xxh3_128":
        pytest.importorskip("xxhash")
    rng = random.Random(nblocks)
    B = 8
    toks = [rng.choice([0, 1, 255, 256, 2**16, 2**31, 2**32 - 1, rng.randrange(2**32)]) for _ in range(nblocks * B + 5)]
    parent = bytes(range(NAME_BYTES))
    for salt in (None, b"", b"tenant-7" * 5):
        want = _names_by_definition(toks, B, salt=salt, algo=algo)
        assert block_names(toks, B, salt=salt, algo=algo) == want
        assert block_names(tuple(toks), B, salt=salt, algo=algo) == want
        for dt in (np.int64, np.uint64, np.uint32, ">u4"):
            assert block_names(np.array(toks, dtype=dt), B, salt=salt, algo=algo) == want
        assert block_names(np.repeat(np.array(toks, dtype=np.int64), 2)[::2], B, salt=salt, algo=algo) == want  # strided
        assert names_of_bytes(np.array(toks, dtype="<u4").tobytes(), B, salt=salt, algo=algo) == want
        got = block_names(toks, B, salt=salt, parent=parent, algo=algo)
        assert got == _names_by_definition(toks, B, salt=salt, parent=parent, algo=algo)


@pytest.mark.parametrize("bad,err", [(([1, 2], 0), ValueError), (([1, 2], True), ValueError),
                                     (([[1, 2]], 1), ValueError), (([1.5, 2], 1), ValueError),
                                     (([-1, 2], 1), ValueError), (([2**32], 1), ValueError)])
def test_bad_names_input(bad, err):
    with pytest.raises(err):
        block_names(*bad)
    with pytest.raises(ValueError):
        block_names(np.array([1.5, 2.0]), 1)  # numpy input is checked the same way
    for arr in (np.array([3, -1]), np.array([2**32, 0], dtype=np.uint64), np.array([2**63], dtype=np.uint64),
                np.array([-2**63]), np.array([5, -128], dtype=np.int8)):
        with pytest.raises(ValueError):
            block_names(arr, 1)
    with pytest.raises(TypeError, match="salt must be bytes"):
        block_names([1], 1, salt="text")


def test_lookup_acquire_release_evict_reset():
    ix = PrefixIndex(128)
    names = block_names(list(range(16)), 4)
    for i, n in enumerate(names[:3]):
        assert ix.publish(n, 10 + i)
    assert not ix.publish(names[0], 99)  # a name cached already keeps its block
    with pytest.raises(ValueError, match="cached already"):
        ix.publish(names[3], 10)
    assert ix.lookup(names) == [10, 11, 12] and ix.lookup(names[3:]) == []
    assert ix.lookup_ids(names, 2).tolist() == [10, 11] and ix.lookup_ids(names, 9).tolist() == [10, 11, 12]
    assert ix.lookup_ids(names, 0).tolist() == ix.lookup_ids(names, -1).tolist() == ix.lookup([]) == []
    assert ix.lookup(names[:2] + names[3:] + names[2:3]) == [10, 11]  # stops at the first miss
    assert ix.cached == 3 and ix.evictable == 0
    ix.acquire([10, 11], queried=4)
    assert (ix.refs(10), ix.shared, ix.query_blocks, ix.hit_blocks) == (2, 2, 4, 2)
    ix.release([10, 11, 12])  # the publisher lets go of all three
    assert ix.evictable == 1 and ix.evict(5) == [12]  # referenced blocks are never evicted
    ix.release([11])
    ix.release([10])
    assert ix.evictable == 2 and ix.evict(1) == [11]  # least recently released first
    assert ix.evictions == 2 and ix.lookup(names) == [10]
    with pytest.raises(KeyError):
        ix.release([10])
    with pytest.raises(KeyError):
        ix.acquire([11])
    assert ix.reset() == [10] and ix.cached == 0 and ix.evictions == 2


def _check(ix: PrefixIndex, model: dict) -> None:
    """Invariants: names and blocks one to one; every cached block referenced or
    evictable, never both; the counts as the model has them."""
    assert len(ix._block_of) == len(ix._name_of) == ix.cached
    assert all(ix._name_of[b] == n for n, b in ix._block_of.items())
    refs, lru = ix.ref_counts(), ix.evictable_order()
    assert set(refs) | set(lru) == set(ix._name_of) and not set(refs) & set(lru)
    assert len(lru) == ix.evictable and all(ix.holds(b) for b in lru)
    assert refs == {b: r for b, r in model.items() if r}


@pytest.mark.parametrize("seed", range(4))
def test_random_trace(seed):
    rng = random.Random(seed)
    ix = PrefixIndex(4096)
    refs: dict[int, int] = {}
    held: list[list[int]] = []
    next_block = 0
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            toks = rng.choice(prompts) + [rng.randrange(50) for _ in range(rng.randrange(0, 8))]
            names = block_names(toks, 4)
            hit = ix.lookup(names)
            ix.acquire(hit, queried=len(names))
            mine = list(hit)
            for n in names[len(hit):]:
                b = next_block
                next_block += 1
                if ix.publish(n, b):
                    mine.append(b)
                    refs[b] = 0
                else:  # cached after an evicted block of the chain: this copy stays private
                    assert ix.lookup([n]) and ix.lookup([n])[0] != b
            for b in mine:
                refs[b] = refs.get(b, 0) + 1
            held.append(mine)
        elif op < 0.8 and held:
            mine = held.pop(rng.randrange(len(held)))
            ix.release(mine)
            for b in mine:
                refs[b] -= 1
        else:
            gone = ix.evict(rng.randrange(0, 4))
            for b in gone:
                assert refs.get(b, 0) == 0
                refs.pop(b, None)
        _check(ix, refs)
    for mine in held:
        ix.release(mine)
    ix.reset()
    assert ix.cached == 0 and ix.evictable == 0
