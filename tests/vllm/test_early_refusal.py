"""A configuration the connector refuses fails at the earliest hook vLLM 0.32 gives a
connector, and the caller's exception carries bsr-io's message.

vLLM builds both connector roles after the weights load and the KV cache is allocated;
the engine core asks the connector class for its KV cache layout
(`get_required_kvcache_layout`) earlier, right after the weights load and before memory
profiling, and bsr-io checks its configuration there. With the engine core in the
caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) the caller gets bsr-io's
ConfigError itself; in the default multiprocess mode vLLM only logs it and raises its
generic start-up error (tests/vllm/test_config.py checks the log).
"""

from __future__ import annotations

import json
import subprocess
import sys

from engines import threads_env

CODE = """
import json, sys
from bsr_io.testing import vllm_harness as harness
model = harness.write_tiny_llama(sys.argv[1])
try:
    harness.engine(model, 1, connector={"store_dir": sys.argv[2], "events_path": sys.argv[3]},
                   policy="fail")
except BaseException as exc:  # what the caller of vLLM's LLM(...) gets
    print(json.dumps({"type": type(exc).__name__, "text": str(exc)}))
    sys.exit(0)
print(json.dumps({"type": None}))
"""


def test_caller_gets_bsr_io_message_before_the_kv_cache(tmp_path):
    env = threads_env(1) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    events = tmp_path / "events.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", CODE, str(tmp_path / "model"), str(tmp_path / "s"), str(events)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["type"] == "ConfigError", got
    assert 'Set "kv_load_failure_policy": "recompute"' in got["text"]
    # Refused before any worker built its connector (which logs a start event once the
    # KV cache exists): the check ran ahead of memory profiling and KV allocation.
    assert not events.exists()
