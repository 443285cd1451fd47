"""Arguments are checked where they enter: one line naming the argument and what it
allows, before anything is read or written; a miss is an ordinary case of the API."""

from __future__ import annotations

import math

import pytest

from bsr_io import Engine, PagedKVCache, Restorer, open_store, preset

LAYOUT = preset("tiny")


@pytest.fixture
def store(tmp_path):
    with Engine(2, LAYOUT.chunk_bytes) as engine:
        s = open_store(engine, tmp_path / "l2", layout=LAYOUT)
        yield engine, s
        s.close()


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"timeout_s": -1}, "timeout_s must be a number of seconds > 0, got -1"),
        ({"timeout_s": 0}, "timeout_s must be a number of seconds > 0, got 0"),
        ({"timeout_s": math.nan}, "timeout_s must be a number of seconds > 0, got nan"),
        ({"timeout_s": True}, "timeout_s must be a number of seconds > 0, got True"),
        ({"timeout_s": "30"}, "timeout_s must be a number of seconds > 0, got '30'"),
        ({"window": 0}, "window must be an int of at least 1 chunk, got 0"),
        ({"window": 1.5}, "window must be an int of at least 1 chunk, got 1.5"),
        ({"install_threads": 0}, "install_threads must be an int >= 1, got 0"),
    ],
)
def test_a_restorer_refuses_bad_arguments_by_name(store, kw, msg):
    engine, s = store
    with pytest.raises(ValueError) as err:
        Restorer(s, LAYOUT, engine=engine, **kw)
    assert str(err.value) == msg


def test_good_arguments_still_build_a_restorer(store):
    engine, s = store
    r = Restorer(s, LAYOUT, engine=engine, timeout_s=0.5, window=2, install_threads=2)
    assert (r.window, r.install_threads) == (2, 2)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_a_preset_refuses_a_chunk_size_that_is_no_size(bad):
    with pytest.raises(ValueError, match=rf"chunk_tokens must be an int >= 1 .*got {bad!r}"):
        preset("tiny", chunk_tokens=bad)
    with pytest.raises(ValueError, match=rf"block_tokens must be an int >= 1 .*got {bad!r}"):
        preset("tiny", block_tokens=bad)


def test_a_preset_without_sizes_keeps_its_own():
    assert preset("tiny").chunk_tokens == preset("tiny", chunk_tokens=None).chunk_tokens > 0


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_allocate_refuses_a_size_that_is_no_size(bad):
    with pytest.raises(ValueError, match=rf"num_tokens must be an int >= 0, got {bad!r}"):
        PagedKVCache.allocate(LAYOUT, bad)


def test_a_miss_allocates_nothing_and_restores_zero(store):
    """The README's pattern on a miss: probe, allocate what the plan hit (nothing),
    restore: `zero`, no exception, and a cache of no blocks."""
    engine, s = store
    restorer = Restorer(s, LAYOUT, engine=engine, model="m")
    plan = restorer.probe(list(range(4 * LAYOUT.chunk_tokens)))
    assert plan.hit_tokens == 0
    dest = PagedKVCache.allocate(LAYOUT, plan.hit_tokens)
    assert dest.capacity_chunks == 0 and all(t.shape[0] == 0 for t in dest.tensors)
    result = restorer.restore(plan, dest)
    assert result.outcome == "zero" and result.committed_tokens == 0


# Each public entry point, given a wrong-typed and a wrong-valued argument: an error of
# bsr-io's own (BsrError) that is also the matching built-in.
def _bad_calls(engine, s, tmp_path):
    from bsr_io import KVLayout, MemoryTier, SSDTier, chunk_keys, prefix_hashes

    r = Restorer(s, LAYOUT, engine=engine)
    tokens = list(range(2 * LAYOUT.chunk_tokens))
    kv = PagedKVCache.allocate(LAYOUT, len(tokens))
    plan = r.probe(tokens)
    (tmp_path / "f").write_bytes(bytes(4096))
    f = engine.open(tmp_path / "f")
    return {
        "Restorer(layout='tiny')": (TypeError, lambda: Restorer(s, "tiny", engine=engine)),
        "Restorer(store=dir)": (TypeError, lambda: Restorer(str(tmp_path), LAYOUT)),
        "Restorer(window=0)": (ValueError, lambda: Restorer(s, LAYOUT, engine=engine, window=0)),
        "probe('abc')": (TypeError, lambda: r.probe("abc")),
        "probe(floats)": (ValueError, lambda: r.probe([0.5] * LAYOUT.chunk_tokens)),
        "probe(request_id=3)": (TypeError, lambda: r.probe(tokens, request_id=3)),
        "restore(plan='p')": (TypeError, lambda: r.restore("p", kv)),
        "restore(dest='kv')": (TypeError, lambda: r.restore(plan, "kv")),
        "restore(other id)": (ValueError, lambda: r.restore(plan, kv, request_id="x")),
        "save(None)": (TypeError, lambda: r.save(None, kv)),
        "save(dest=1)": (TypeError, lambda: r.save(tokens, 1)),
        "save(2-D)": (ValueError, lambda: r.save([tokens], kv)),
        "allocate('tiny')": (TypeError, lambda: PagedKVCache.allocate("tiny", 4)),
        "allocate(-1)": (ValueError, lambda: PagedKVCache.allocate(LAYOUT, -1)),
        "preset('nope')": (ValueError, lambda: preset("nope")),
        "preset(chunk_tokens=0)": (ValueError, lambda: preset("tiny", chunk_tokens=0)),
        "KVLayout(groups=())": (ValueError, lambda: KVLayout("x", ())),
        "open_store(dir=3)": (TypeError, lambda: open_store(engine, 3)),
        "open_store(engine='e')": (TypeError, lambda: open_store("e", tmp_path)),
        "open_store(ssd_bytes=-1)": (
            ValueError,
            lambda: open_store(engine, tmp_path, ssd_bytes=-1),
        ),
        "SSDTier(root=3)": (TypeError, lambda: SSDTier(3, None, engine)),
        "MemoryTier(-1)": (ValueError, lambda: MemoryTier(-1)),
        "chunk_keys(model='')": (ValueError, lambda: chunk_keys(tokens, LAYOUT, "")),
        "prefix_hashes({})": (TypeError, lambda: prefix_hashes({}, 4)),
        "prefix_hashes(0)": (ValueError, lambda: prefix_hashes(tokens, 0)),
        "Engine(window=0)": (ValueError, lambda: Engine(0, 4096)),
        "Engine(window='a')": (TypeError, lambda: Engine("a", 4096)),
        "Engine(slot_bytes=1.5)": (TypeError, lambda: Engine(2, 1.5)),
        "Engine(queue_depth='8')": (TypeError, lambda: Engine(2, 4096, queue_depth="8")),
        "Engine(backend=3)": (TypeError, lambda: Engine(2, 4096, backend=3)),
        "engine read offset -1": (ValueError, lambda: engine.submit_read(f, -1, 4096)),
    }


def test_every_entry_point_refuses_bad_arguments_as_bsr_error_and_builtin(store, tmp_path):
    from bsr_io import BsrError

    engine, s = store
    wrong = {}
    for name, (builtin, call) in _bad_calls(engine, s, tmp_path).items():
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the class is what is checked
            if not (isinstance(exc, BsrError) and isinstance(exc, builtin)):
                wrong[name] = f"{type(exc).__name__}: {exc}"
        else:
            wrong[name] = "no error"
    assert wrong == {}
