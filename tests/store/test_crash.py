"""kill -9 of a writer process, at random moments and at chosen steps of a write, then
reopen and verify: every committed record intact, no torn record visible, no temp file
left behind."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import synthetic_chunk, synthetic_tokens
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.tiers import LowerTier, SSDTier

# ~540 KiB chunks: a write takes long enough to be killed in the middle of it.
LAYOUT = preset("tiny", chunk_tokens=4096)
CHUNKS = 40

_WRITER = r"""
import os, signal, sys, threading, time
from bsr_io import Engine
from bsr_io._core import stall_publish
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.cli.synthetic import synthetic_chunk, synthetic_tokens
from bsr_io.tiers import LowerTier, SSDTier

kind, root, seed, point, at = sys.argv[1:6]
seed, at = int(seed), int(at)
lay = preset("tiny", chunk_tokens=4096)
keys = chunk_keys(synthetic_tokens(seed, lay.chunk_tokens * @CHUNKS@), lay, "crash")

def die_when_held(stall):
    while stall.hits == 0:
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)

if point != "random" and kind == "L2":
    # Fault double, in this child only: the `at`-th record's publication (one native
    # call) is held just before the step's system call, and the process dies there.
    step = {"write": "write", "rename": "rename", "dirsync": "dirsync"}[point]
    arm_at = at - 1
elif point != "random":
    # Test double, in this child only: die by SIGKILL at the `at`-th call of one step.
    arm_at = None
    target = {"write": "pwrite", "rename": "rename", "dirsync": "fsync"}[point]
    real = getattr(os, target)
    calls = [0]
    def dying(*a, **kw):
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)
    setattr(os, target, dying)

with Engine(2, lay.chunk_bytes) as eng:
    tier = SSDTier(root, None, eng) if kind == "L2" else LowerTier(root)
    print("ready", flush=True)
    for i, key in enumerate(keys):
        if point != "random" and i == arm_at:
            held = stall_publish(step, root)
            threading.Thread(target=die_when_held, args=(held,), daemon=True).start()
        tier.write(key, synthetic_chunk(lay, seed, i), lay)
        print("committed", i, flush=True)
""".replace("@CHUNKS@", str(CHUNKS))


def run_writer(kind, root, seed, point, at, kill_after=None):
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, kind, str(root), str(seed), point, str(at)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "ready\n", proc.stderr.read()
    if kill_after is not None:
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    committed = {int(line.split()[1]) for line in out.splitlines() if line.startswith("committed")}
    return proc.returncode, committed, err


def verify(kind, root, engine, committed_by_seed):
    """Reopen; every visible record must be a whole, verified record we wrote."""
    tier = SSDTier(root, None, engine) if kind == "L2" else LowerTier(root)
    assert tier.problems == []  # nothing torn became visible
    assert not list(root.rglob("*.tmp"))  # the dead writer's temp file was removed
    expected = {}
    for seed in committed_by_seed:
        keys = chunk_keys(synthetic_tokens(seed, LAYOUT.chunk_tokens * CHUNKS), LAYOUT, "crash")
        expected.update({k: (seed, i) for i, k in enumerate(keys)})
    visible = tier.keys()
    for key in visible:
        seed, i = expected[key]
        slot = tier.read_into(key, engine)
        assert bytes(memoryview(slot)) == synthetic_chunk(LAYOUT, seed, i).tobytes()
        del slot
    for seed, committed in committed_by_seed.items():
        keys = chunk_keys(synthetic_tokens(seed, LAYOUT.chunk_tokens * CHUNKS), LAYOUT, "crash")
        assert all(tier.contains(keys[i]) for i in committed), "a committed record was lost"
    return len(visible)


@pytest.mark.parametrize("kind", ["L2", "L3"])
def test_kill_at_random_moments(kind, tmp_path):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    committed_by_seed = {}
    with Engine(2, LAYOUT.chunk_bytes) as engine:
        for seed in range(4):
            rc, committed, err = run_writer(
                kind, tmp_path, seed, "random", 0, kill_after=rng.uniform(0.0, 0.3)
            )
            assert rc in (-signal.SIGKILL, 0), err
            committed_by_seed[seed] = committed
            visible = verify(kind, tmp_path, engine, committed_by_seed)
            print(f"seed {seed}: {len(committed)} committed, {visible} visible")


@pytest.mark.parametrize("kind", ["L2", "L3"])
@pytest.mark.parametrize("point", ["write", "rename", "dirsync"])
def test_kill_at_each_step_of_a_write(kind, point, tmp_path):
    committed_by_seed = {}
    with Engine(2, LAYOUT.chunk_bytes) as engine:
        for seed, at in enumerate(random.Random(point).sample(range(1, 9), 2)):
            rc, committed, err = run_writer(kind, tmp_path, seed, point, at)
            assert rc == -signal.SIGKILL, err
            committed_by_seed[seed] = committed
            visible = verify(kind, tmp_path, engine, committed_by_seed)
            assert visible >= sum(map(len, committed_by_seed.values()))
