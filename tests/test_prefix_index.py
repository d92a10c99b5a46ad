"""The prefix-reuse block index (``hisparse.cache.prefix_index``), host-side: chained
block names (prefix property, salt, a running chain fed in pieces, partial blocks, bad
input), longest-prefix lookup, parents and chains, reference counts, LRU eviction of
unreferenced blocks only, reset, and a randomized trace against a plain model with the
index's invariants checked after every operation."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from hisparse.cache.prefix_index import (
    NAME_BYTES,
    NameChain,
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
    ch = NameChain(4)
    assert ch.extend(np.arange(6)) == a[:1] and ch.blocks == 1 and ch.tail.tolist() == [4, 5]
    assert ch.extend(np.arange(6, 9)) == a[1:2] and ch.name == a[1] and ch.tail.tolist() == [8]  # a follow-up
    sk = NameChain(4)
    sk.skip(np.arange(8))
    assert sk.name == a[1] and sk.blocks == 2 and sk.copy().extend(np.arange(8, 12)) == block_names(range(12), 4)[2:]
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


def _names_by_definition(toks, B, salt=None, algo="sha256"):
    """name_i = H(H(salt) or 16 zero bytes || the ids of blocks 0..i as little-endian
    uint32), 16 bytes — each from scratch, one hash call over the whole prefix."""
    def H(b):
        if algo == "sha256":
            return hashlib.sha256(b).digest()[:NAME_BYTES]
        import xxhash
        return xxhash.xxh3_128_digest(b)

    salted = H(salt) if salt is not None else bytes(NAME_BYTES)
    raw = b"".join(int(t).to_bytes(4, "little") for t in toks)
    return [H(salted + raw[:4 * B * (i + 1)]) for i in range(len(toks) // B)]


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
@pytest.mark.parametrize("nblocks", [0, 1, 3, 15, 16, 40])  # both sides of the row layout's threshold
def test_names_are_the_definition(algo, nblocks):
    if algo == "xxh3_128":
        pytest.importorskip("xxhash")
    rng = random.Random(nblocks)
    B = 8
    toks = [rng.choice([0, 1, 255, 256, 2**16, 2**31, 2**32 - 1, rng.randrange(2**32)]) for _ in range(nblocks * B + 5)]
    for salt in (None, b"", b"tenant-7" * 5):
        want = _names_by_definition(toks, B, salt=salt, algo=algo)
        assert block_names(toks, B, salt=salt, algo=algo) == want
        assert block_names(tuple(toks), B, salt=salt, algo=algo) == want
        for dt in (np.int64, np.uint64, np.uint32, ">u4"):
            assert block_names(np.array(toks, dtype=dt), B, salt=salt, algo=algo) == want
        assert block_names(np.repeat(np.array(toks, dtype=np.int64), 2)[::2], B, salt=salt, algo=algo) == want  # strided
        assert names_of_bytes(np.array(toks, dtype="<u4").tobytes(), B, salt=salt, algo=algo) == want
        ch, got = NameChain(B, salt=salt, algo=algo), []
        for cut in sorted(rng.sample(range(len(toks) + 1), 3)) + [len(toks)]:  # fed in pieces
            got += ch.extend(np.array(toks[ch.blocks * B + len(ch.tail):cut], dtype=np.int64))
        assert got == want


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
        assert ix.publish(n, 10 + i, 9 + i if i else -1)
    assert not ix.publish(names[0], 99)  # a name cached already keeps its block
    with pytest.raises(ValueError, match="cached already"):
        ix.publish(names[3], 10, 12)
    with pytest.raises(ValueError, match="parent block 13 of block 14 is not cached"):
        ix.publish(names[3], 14, 13)
    assert ix.block_of(names[2]) == 12 and ix.block_of(names[3]) == -1
    assert ix.chain(12).tolist() == [10, 11, 12] and ix.chain(10).tolist() == [10]
    ix.check()
    assert ix.lookup(names) == [10, 11, 12] and ix.lookup(names[3:]) == []
    assert ix.lookup_ids(names, 2).tolist() == [10, 11] and ix.lookup_ids(names, 9).tolist() == [10, 11, 12]
    assert ix.lookup_ids(names, 0).tolist() == ix.lookup_ids(names, -1).tolist() == ix.lookup([]) == []
    assert ix.lookup(names[:2] + names[3:] + names[2:3]) == [10, 11]  # stops at the first miss
    assert ix.cached == 3 and ix.evictable == 0
    ix.acquire([10, 11], queried=4)
    assert (ix.refs(10), ix.shared, ix.query_blocks, ix.hit_blocks) == (2, 2, 4, 2)
    ix.release([10, 11, 12])  # the publisher lets go of all three
    assert ix.evictable == 1 and ix.evict(5) == [12]  # referenced blocks are never evicted
    with pytest.raises(RuntimeError, match="block 12 is not cached"):
        ix.chain(12)  # evicted
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
    ix.check()
    refs, lru = ix.ref_counts(), ix.evictable_order()
    assert set(refs) | set(lru) == set(ix._name_of) and not set(refs) & set(lru)
    assert len(lru) == ix.evictable and all(ix.holds(b) for b in lru)
    assert refs == {b: r for b, r in model.items() if r}


@pytest.mark.parametrize("seed", range(6))
def test_random_trace(seed):
    """Requests look up, then publish their blocks later (two with one prompt may both
    have computed it: the second references the cached block in place of its copy, as
    ``hisparse.cache.prefix`` does), and release last block first."""
    rng = random.Random(seed)
    ix = PrefixIndex(4096)
    refs: dict[int, int] = {}
    live: list[dict] = []  # each: names, position-ordered refs ("mine"), blocks published so far
    next_block = 0
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    dups = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            toks = rng.choice(prompts) + [rng.randrange(50) for _ in range(rng.randrange(0, 8))]
            names = block_names(toks, 4)
            hit = ix.lookup(names)
            if hit:
                assert ix.chain(hit[-1]).tolist() == hit  # the parents lead back along the prompt
            ix.acquire(hit, queried=len(names))
            for b in hit:
                refs[b] += 1
            live.append({"names": names, "mine": list(hit), "done": len(hit)})
        elif op < 0.55 and live:
            q = rng.choice(live)
            upto = rng.randrange(q["done"], len(q["names"]) + 1)
            for i in range(q["done"], upto):
                parent = q["mine"][-1] if q["mine"] else -1
                b = next_block
                next_block += 1
                if ix.publish(q["names"][i], b, parent):
                    refs[b] = 1
                else:  # computed by another request first: reference that one instead
                    b = ix.block_of(q["names"][i])
                    ix.acquire([b])
                    refs[b] += 1
                    dups += 1
                q["mine"].append(b)
            q["done"] = upto
        elif op < 0.8 and live:
            q = live.pop(rng.randrange(len(live)))
            ix.release(q["mine"][::-1])
            for b in q["mine"]:
                refs[b] -= 1
        else:
            gone = ix.evict(rng.randrange(0, 4))
            for b in gone:
                assert refs.pop(b) == 0
        _check(ix, refs)
    for q in live:
        ix.release(q["mine"][::-1])
    ix.reset()
    assert ix.cached == 0 and ix.evictable == 0 and dups > 0


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
def test_prefix_cache_lookup_every_hit_length(algo):
    """``PrefixCache.lookup`` (the first name, the last, then a binary search) finds the
    same blocks as naming every block and walking them, at every hit length, with the
    chain it returns positioned after the hit; a cold prompt asks one name."""
    if algo == "xxh3_128":
        pytest.importorskip("xxhash")
    from hisparse import HiSparseConfig
    from hisparse.cache.host_pool import BlockAllocator
    from hisparse.cache.prefix import PrefixCache

    B, n = 4, 13
    cfg = HiSparseConfig(num_layers=1, host_pool_tokens=64 * B, row_bytes=16, top_k=4, max_num_reqs=2,
                         host_block_size=B, prefix_caching=True, prefix_hash=algo)
    pc = PrefixCache(cfg, BlockAllocator(cfg.num_host_blocks))
    rng = random.Random(7)
    base = [rng.randrange(1000) for _ in range(n * B)]
    for i, name in enumerate(block_names(base, B, algo=algo)):
        assert pc.index.publish(name, 20 + i, 19 + i if i else -1)
    for k in range(n + 1):  # the first k blocks agree with the cached prompt
        for extra in (0, 1, B + 2):
            toks = base[:k * B] + [1000 + j for j in range((n - k) * B + extra)]
            ids = pc.check_ids(toks)
            hit, chain = pc.lookup(ids, None)
            cap = (len(toks) - 1) // B
            want = pc.index.lookup_ids(block_names(toks, B, algo=algo), cap)
            assert hit.tolist() == want.tolist() == list(range(20, 20 + min(k, cap)))
            assert chain.blocks == len(hit) and len(chain.tail) == 0
            if len(hit):
                assert chain.name == block_names(toks, B, algo=algo)[len(hit) - 1]
            assert chain.copy().extend(ids[len(hit) * B:]) == block_names(toks, B, algo=algo)[len(hit):]
    salted, _ = pc.lookup(pc.check_ids(base), b"other model")
    assert salted.tolist() == [] and pc.lookup(pc.check_ids(base[:1]), None)[0].tolist() == []
