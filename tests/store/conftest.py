"""Fixtures shared by the store tests: an engine whose slots hold one chunk of the tiny
layout, and the keys of eight chunks of it."""

import numpy as np
import pytest
from tiny_tiers import LAYOUT

from bsr_io import Engine
from bsr_io.model.keys import chunk_keys


@pytest.fixture
def engine():
    with Engine(4, LAYOUT.chunk_bytes) as eng:
        yield eng


@pytest.fixture
def keys():
    return chunk_keys(np.arange(LAYOUT.chunk_tokens * 8), LAYOUT, "test/model")
