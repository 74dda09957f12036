"""How the client reads a node's packed presence masks (``dkv.client._unpack_masks``): one byte per hash."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dkv import client
from dkv.errors import ProtocolError


@pytest.mark.parametrize("length", [0, 1, 2, 31, 32, 33, 100, 4096])
def test_a_byte_1_is_present_and_any_other_absent_however_long_the_mask(length: int) -> None:
    rng = random.Random(length)
    packed = bytes(rng.choice([0, 1, 1, 2, 255]) for _ in range(length))
    masks = client._unpack_masks({"a": packed, "b": bytes(length)}, length)  # noqa: SLF001
    assert masks == {"a": [b == 1 for b in packed], "b": [False] * length}
    assert masks["a"] == (np.frombuffer(packed, dtype=np.uint8) == 1).tolist()  # the same as the array pass
    assert all(type(v) is bool for v in masks["a"])


@pytest.mark.parametrize("raw", [{"a": b"\x01\x01"}, {"a": "\x01\x01\x01"}, ["not", "a", "map"]],
                         ids=["short", "not-bytes", "not-a-map"])
def test_a_mask_of_the_wrong_length_or_kind_is_a_protocol_error(raw: object) -> None:
    with pytest.raises(ProtocolError):
        client._unpack_masks(raw, 3)  # noqa: SLF001
