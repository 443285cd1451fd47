"""A read the kernel holds past the deadline never hands SGLang a page it may still write.

A real kernel stall (one record's payload served late through FUSE, tests/fuse_stall.py)
against SGLang's own host pool and the factory-built backend with default settings and a
1 s deadline; the case runs in a process of its own (stall_worker.py says why). Before,
`batch_get_v1` returned `[True, False, False, False]` at the deadline; SGLang frees the
false pages and reuses them, and the given-up O_DIRECT read then landed in the reused
page: backed up under another prefix's key, a fresh reader was served `True` for bytes of
the wrong prefix. And the next load into those pages through a new page view was not
refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def test_a_stalled_read_never_hands_back_a_page_the_kernel_may_write(
    run_stall_worker: Callable[[str], dict[str, Any]],
) -> None:
    facts = run_stall_worker("stall_worker.py")
    assert facts["aligned"], facts  # else no direct read: the case would not be this one
    # While the kernel holds page 1's read, the batch has not answered (its pages are not
    # SGLang's to free) and the backend reports no hit, so no new load starts.
    assert facts["held_by_backend"], facts
    assert facts["exists_while_held"] == 0, facts
    assert facts["one_owner"], facts  # registration and kernel's range in one object
    # A new view over the same pages is refused before reading anything.
    assert "still owned by the kernel" in facts["new_view_error"], facts
    assert facts["new_view_read"] == {}, facts
    # Then it answers: page 0 verified, the rest false; page 1 was read in place.
    assert facts["got"] == [True, False, False, False], facts
    assert facts["direct_pages"] >= 1, facts
    assert facts["returned"], facts
    # The pages SGLang reused hold what it wrote there, never the late bytes ...
    assert facts["reused_intact"], facts
    assert not any(facts["late_bytes_in_reused"]), facts
    # ... and what a fresh reader is served `True` is exactly the other prefix's bytes.
    assert facts["backed_up"] == [True, True, True], facts
    assert facts["fresh_got"] == [True, True, True], facts
    assert facts["fresh_right"] == [True, True, True], facts
