"""`vllm serve` with bsr-io, started as the README shows it, answering over HTTP.

The command is the README's own (its vLLM section's `vllm serve` block): the test reads
it, puts the tiny model in place of MODEL and a scratch directory in place of the store,
and adds only what the tiny model and the test need (no tokenizer, a small max length,
127.0.0.1 and a free port, per-prompt cache details). A long prompt is sent, vLLM's own
prefix cache is dropped (`POST /reset_prefix_cache`, VLLM_SERVER_DEV_MODE), and the
same prompt again must be served from the connector: cached tokens reported, vLLM's
external-hit counter up by as many, every rank's load complete, the same greedy output.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import pytest

from bsr_lab.vllm.harness import KV_CACHE_BYTES, Events, tokens, write_tiny_llama
from bsr_lab.vllm.server import Server, vllm_exe

ROOT = Path(__file__).resolve().parents[3]


def documented_serve(path: Path) -> list[str]:
    """The arguments of the first `vllm serve MODEL ... --kv-transfer-config` command in a
    markdown file's bash blocks (line continuations joined)."""
    text = path.read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        cmd = block.replace("\\\n", " ")
        if "vllm serve MODEL" in cmd and "--kv-transfer-config" in cmd:
            args = shlex.split(cmd[cmd.index("vllm serve MODEL") :])
            return args
    raise AssertionError(f"no `vllm serve MODEL ... --kv-transfer-config` block in {path}")


def test_readme_and_docs_show_the_same_command():
    assert documented_serve(ROOT / "README.md") == documented_serve(ROOT / "docs" / "vllm.md")


def external_hits(srv: Server) -> float:
    return sum(
        v for k, v in srv.metrics().items() if k.startswith("vllm:external_prefix_cache_hits_total")
    )


@pytest.fixture(scope="module")
def served(vllm_root):
    work = vllm_root / "serve"
    work.mkdir()
    model = write_tiny_llama(work / "model")
    args = documented_serve(ROOT / "README.md")
    assert args[:3] == ["vllm", "serve", "MODEL"], args
    i = args.index("--kv-transfer-config")
    kv = json.loads(args[i + 1])
    extra = kv["kv_connector_extra_config"]
    extra["store_dir"] = str(work / "store")
    extra["events_path"] = str(work / "events.jsonl")
    args[i + 1] = json.dumps(kv)
    srv = Server(
        model,
        log=work / "serve.log",
        base_args=False,
        args=[
            *args[3:],
            "--skip-tokenizer-init",  # the tiny model has none: token-id prompts
            "--max-model-len",
            "4096",
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--enable-prompt-tokens-details",  # cached_tokens in each response
        ],  # fmt: skip
        threads_bind="0-1",
    )
    assert srv.command()[:3] == [vllm_exe(), "serve", model]
    srv.start()
    try:
        srv.wait_ready(600)
        yield srv, Events(extra["events_path"]), extra
    finally:
        srv.stop()
        print(srv.log_tail(3000))


def test_a_repeat_is_served_by_the_connector(served):
    srv, events, cfg = served
    chunk = cfg["chunk_tokens"]
    prompt = tokens(31, 5 * chunk + 40)
    first = srv.complete(prompt, max_tokens=16)
    # By default (`save_in_steps`) each record is cut in the step that computed it and
    # written by the workers' writers: wait for the five.
    deadline = time.monotonic() + 300
    while len([e for e in events.all() if e.get("kind") == "step_save"]) < 5:
        assert time.monotonic() < deadline, f"records not cut in steps: {events.all()}"
        assert srv.alive(), srv.log_tail()
        time.sleep(0.2)
    steps = [e for e in events.all() if e.get("kind") == "step_save"]
    assert [e["outcome"] for e in steps] == ["complete"] * 5, steps
    assert not [e for e in events.all() if e.get("kind") == "save"]  # no finish save
    srv.reset_prefix_cache()
    hits_before = external_hits(srv)
    second = srv.complete(prompt, max_tokens=16)
    assert second.cached == 5 * chunk, (first, second)
    assert external_hits(srv) - hits_before == 5 * chunk
    loads = [e for e in events.all() if e.get("kind") == "load"]
    assert [e["outcome"] for e in loads] == ["complete"], loads
    assert second.tokens == first.tokens
    assert not errors(srv.log_tail(10**7))


def errors(log: str) -> list[str]:
    """The log's error lines and tracebacks, but for vLLM's own warning that it could not
    warm up a chat template without a tokenizer (a WARNING with its traceback)."""
    return [
        line
        for line in log.splitlines()
        if (" ERROR " in line or "Traceback" in line or "CRITICAL" in line)
        and " WARNING " not in line
    ]


def test_records_saved_at_finish_serve_a_repeat(vllm_root):
    """`save_in_steps` false: no record is cut in a step; vLLM keeps the finished
    request's blocks until the workers report its save, and a repeat restores it."""
    work = vllm_root / "serve-at-finish"
    work.mkdir()
    chunk = 256
    events = Events(str(work / "events.jsonl"))
    srv = Server(
        write_tiny_llama(work / "model"),
        connector={
            "store_dir": str(work / "store"),
            "chunk_tokens": chunk,
            "events_path": events.path,
            "save_in_steps": False,
        },
        log=work / "serve.log",
        max_model_len=4096,
        threads_bind="0",
    )
    srv.start()
    try:
        srv.wait_ready(600)
        prompt = tokens(32, 5 * chunk + 40)
        first = srv.complete(prompt, max_tokens=16)
        deadline = time.monotonic() + 120
        done = [e for e in events.all() if e.get("kind") == "save"]
        while not [e for e in done if e["outcome"] == "complete"]:
            assert time.monotonic() < deadline, f"no finish save: {events.all()}"
            time.sleep(0.2)
            done = [e for e in events.all() if e.get("kind") == "save"]
        assert [e["outcome"] for e in done] == ["complete"], done
        assert done[0]["written"] == 5, done
        assert not [e for e in events.all() if e.get("kind") == "step_save"]
        srv.reset_prefix_cache()
        second = srv.complete(prompt, max_tokens=16)
        assert second.cached == 5 * chunk, (first, second)
        assert second.tokens == first.tokens
        assert not errors(srv.log_tail(10**7))
    finally:
        srv.stop()
