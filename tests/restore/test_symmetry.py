"""Every request ends the same on every rank.

Two real gloo ranks serve a sequence of requests; rank 1 is late by more than the
agreement timeout at one phase of some of them (bsr_lab.requests: a sleep
before the probe, or a slow destination, documented doubles). Each request must end
with the same outcome and committed tokens on both ranks, the late ones `zero`, and
the ranks must be back in step for the requests after them.
"""

from __future__ import annotations

from bsr_io.cli.ranks import launch

TARGET = "bsr_lab.requests:serve_on_rank"
TIMEOUT_S = 3.0
LATE_S = 4.5  # later than the timeout, earlier than two of them (see below)
TOKENS = 8 * 16


def _serve(tmp_path, requests):
    results = launch(
        2,
        TARGET,
        {
            "root": str(tmp_path),
            "requests": requests,
            "tokens": TOKENS,
            "timeout_s": TIMEOUT_S,
            "late_s": LATE_S,
        },
        timeout_s=240,
        env={"BSR_IO_EXIT_WAIT_S": "5"},
    )
    for r in results:
        assert "requests" in r, f"rank failed: {r}"
    return [r["requests"] for r in results]


def _same_on_both(r0, r1):
    for i, (a, b) in enumerate(zip(r0, r1, strict=True)):
        assert (a["outcome"], a["committed_tokens"]) == (b["outcome"], b["committed_tokens"]), (
            f"request {i} differs between ranks: {a} vs {b}"
        )


def test_a_late_rank_at_each_phase_stays_in_step(tmp_path):
    # A late rank that finds the decision taken adopts it at once, so it reaches the
    # next request within LATE_S < 2 * TIMEOUT_S of its peer: that request completes.
    requests = [
        {},
        {"late": {"1": "discovery"}},
        {},
        {"miss": True},  # a zero hit: no vote, still in step
        {"late": {"1": "install"}},
        {},
        {"late": {"1": "vote"}},
        {},
        {},
        {},
    ]
    r0, r1 = _serve(tmp_path, requests)
    _same_on_both(r0, r1)
    for i in (1, 4, 6):
        assert r0[i]["outcome"] == "zero" and r0[i]["reason"], r0[i]
    assert r0[3]["outcome"] == "zero"
    # Back in step: the requests after the last late one complete. (2, 5 and 7 do too
    # unless the host stalls a rank for more than 2 * TIMEOUT_S - LATE_S; then they
    # end zero on both, which the check above still requires.)
    for i in (0, 8, 9):
        assert r0[i]["outcome"] == "complete", (i, r0[i], r1[i])
    for i, (a, b) in enumerate(zip(r0, r1, strict=True)):
        if a["outcome"] == "complete":
            assert a["committed_tokens"] == TOKENS and a["data_ok"] and b["data_ok"], i


def test_caller_request_ids_and_a_retry(tmp_path):
    requests = [
        {"id": "a"},
        {"id": "b", "late": {"1": "discovery"}},
        {"id": "b"},  # the same request again: its own decision, not the first one's
        {"id": "c"},
    ]
    r0, r1 = _serve(tmp_path, requests)
    _same_on_both(r0, r1)
    assert [x["outcome"] for x in r0][:2] == ["complete", "zero"]
    assert r0[3]["outcome"] == "complete"


def test_an_install_that_raises_aborts_the_peers_at_once(tmp_path):
    r0, r1 = _serve(tmp_path, [{}, {"late": {"0": "raise"}}, {}])
    assert r0[1]["outcome"] == "raised"  # the caller gets its exception...
    # ...after the abort is published: the peer ends zero without waiting the timeout.
    assert r1[1]["outcome"] == "zero" and "rank 0" in r1[1]["reason"], r1[1]
    assert r1[1]["seconds"] < TIMEOUT_S
    assert r0[2]["outcome"] == r1[2]["outcome"] == "complete"
