"""The node-loss drill on the two-node launcher (vllm-multinode.md, docs/vllm.md "Several
nodes"): one vLLM engine at TP=2 over two nodes (`vllm serve --nnodes 2`), each node with
its own drive at `store_dir`, as in test_two_nodes.py.

1. A prompt is computed and saved on both ranks.
2. Three requests are decoding (vLLM's own `num_requests_running` on node 0 says 3, so
   the engine is stepping them in TP steps) when node 1's whole process tree is killed
   with SIGKILL (a crash: nothing flushes, no goodbye on any socket).
3. Each of those requests must end with an error within vLLM's executor bound
   (`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`, the setting docs/vllm.md tells deployments to
   set; these nodes set it to `EXECUTE_S`), and node 0 must exit after: nothing waits on
   the dead node past it. Where the kill lands decides which path ends them (both seen
   here): node 0's worker inside the step's collective fails at once (gloo: "Connection
   reset by peer", 1.5 s after the kill on a loaded host); node 0's executor waiting for
   the step's output from node 1 gives up at the bound ("RPC call to sample_tokens timed
   out", 30.02 s).
4. Both nodes restarted: the prompt of step 1 restores on both ranks (each rank's load
   event says complete, the same number of chunks on each) with the same output as
   its computation in step 1.

One engine start with the connector, one restart; the same tiny Llama as the other
two-node tests.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from node_pair import NodePair, node_pair

from bsr_lab.vllm.harness import CHUNK_TOKENS, SAVE_END, tokens
from bsr_lab.vllm.nodes import Cluster

EXECUTE_S = 30  # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS on both nodes
# After the bound fires, the engine's error still travels to the API server and the
# client (0.02 s seen); a hang has no end at all.
ERROR_PATH_S = 30
NODE_ENV = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(EXECUTE_S)}
IN_FLIGHT = 3
# gloo's words for a peer that went away (lower case; its own strings, in libtorch).
PEER_GONE = ("connection reset by peer", "connection closed by peer", "broken pipe")
# Long enough that every in-flight request is still decoding when node 1 dies (each
# decode step of this model takes milliseconds; these take minutes to finish).
DECODE_TOKENS = 6000
PROMPT = tokens(61, 10 * CHUNK_TOKENS + 17)


def _in_flight(c: Cluster, n: int, out: list[dict[str, Any]]) -> list[threading.Thread]:
    """`n` long greedy completions sent at once over node 0's API, each recording how it
    ended (its tokens, or the error the client saw) and when (monotonic seconds)."""

    def send(i: int) -> None:
        try:
            r = c.complete(tokens(70 + i, 2 * CHUNK_TOKENS + 5), max_tokens=DECODE_TOKENS)
            out[i] |= {"tokens": len(r.tokens)}
        except (RuntimeError, OSError) as exc:  # the server's error reply, or none
            out[i] |= {"error": repr(exc)[:300]}
        out[i]["ended"] = time.monotonic()

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _running(c: Cluster) -> float:
    samples = c.nodes[0].metrics()
    return sum(v for k, v in samples.items() if k.startswith("vllm:num_requests_running"))


def _drill(pair: NodePair) -> dict[str, Any]:
    events = pair.events
    cfg = pair.connector(load_timeout_s=float(EXECUTE_S))
    c = pair.cluster("bsr", cfg, (NODE_ENV, NODE_ENV))
    out: dict[str, Any] = {}
    c.start()
    try:
        c.wait_ready()
        first = c.complete(PROMPT)
        saved = events.wait(first.request_id, SAVE_END, 2, timeout=300)
        out["first"] = {"tokens": first.tokens, "cached": first.cached or 0}
        out["saved"] = {e["rank"]: e["outcome"] for e in saved}
        ends: list[dict[str, Any]] = [{} for _ in range(IN_FLIGHT)]
        threads = _in_flight(c, IN_FLIGHT, ends)
        deadline = time.monotonic() + 300
        while _running(c) < IN_FLIGHT and time.monotonic() < deadline:
            time.sleep(0.2)
        out["running_at_kill"] = _running(c)
        killed_at = time.monotonic()
        c.kill(1)
        for t in threads:
            t.join(timeout=EXECUTE_S + 300)  # past the bound: the test fails, not hangs
        out["ends"] = [
            {k: v for k, v in e.items() if k != "ended"}
            | ({"after_kill_s": e["ended"] - killed_at} if "ended" in e else {})
            for e in ends
        ]
        # Node 0 shuts its server down once its engine died (vLLM's
        # VLLM_KEEP_ALIVE_ON_ENGINE_DEATH unset).
        last = max((e.get("ended", killed_at) for e in ends), default=killed_at)
        while c.nodes[0].alive() and time.monotonic() < last + ERROR_PATH_S:
            time.sleep(0.2)
        out["node0_exited_after_s"] = None if c.nodes[0].alive() else time.monotonic() - killed_at
    finally:
        c.stop()
    log0 = c.log_tail(0, 400_000)
    out["log0"] = log0[-4000:]
    # How the step ended on node 0: gloo saw the peer go (reset, or closed: its message
    # depends on whether the kill's FIN or RST came first), or a wait timed out (gloo's
    # "Timed out waiting", vLLM's execute timeout).
    low = log0.lower()
    out["cause"] = [why for why in PEER_GONE + ("timed out",) if why in low]
    c.start()  # both nodes, the same drives
    try:
        c.wait_ready()
        again = c.complete(PROMPT)
        loads = events.of(again.request_id, "load")
        out["restored"] = {
            "tokens": again.tokens,
            "cached": again.cached or 0,
            "loads": {e["rank"]: (e["outcome"], e.get("chunks")) for e in loads},
            "reasons": [e.get("reason") for e in loads],
        }
    finally:
        c.stop()
    return out


@pytest.fixture(scope="module")
def drill(vllm_root: Path) -> dict[str, Any]:
    out = _drill(node_pair(vllm_root, "node-loss"))
    print(f"node-loss drill: { ({k: v for k, v in out.items() if k != 'log0'}) }")
    return out


def test_requests_in_a_tp_step_end_with_an_error_within_the_bound(drill):
    assert drill["saved"] == {0: "complete", 1: "complete"}, drill["saved"]
    assert drill["running_at_kill"] == IN_FLIGHT, drill  # else nothing was in a step
    for end in drill["ends"]:
        assert "after_kill_s" in end, (end, drill["log0"])  # still waiting: a hang
        assert "error" in end, (end, drill["log0"])  # an answer would be a wrong answer
        assert end["after_kill_s"] <= EXECUTE_S + ERROR_PATH_S, (end, drill["log0"])
    assert drill["cause"], drill["log0"]  # one of the two paths ended the step


def test_node_0_does_not_outlive_its_engine(drill):
    # A mid-step kill ends node 0's engine; its API server then exits (docs/vllm.md).
    assert drill["node0_exited_after_s"] is not None, drill["log0"]


def test_both_nodes_restarted_restore_the_prompt_on_both_ranks(drill):
    first, again = drill["first"], drill["restored"]
    assert first["cached"] == 0
    # Each rank's load event: complete, the same 10 chunks on both.
    assert again["loads"] == {0: ("complete", 10), 1: ("complete", 10)}, again
    assert again["cached"] >= 10 * CHUNK_TOKENS, again
    assert again["tokens"] == first["tokens"]
