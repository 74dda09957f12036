"""The transfer plan: every bad leaf, hash and block id is refused before anything moves; keys pair with rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from connector.transfer_plan import leaf_tensors, plain_block_ids, plain_block_ids_python, plan_transfer
from dkv.keys import BlockKey

H = [bytes([i]) * 8 for i in range(1, 5)]


def tensors_of(tp: int = 2, pages: int = 8) -> dict[str, list[torch.Tensor]]:
    return {"full": [torch.zeros(pages, 16, dtype=torch.uint8) for _ in range(tp)],
            "swa": [torch.zeros(pages, 32, dtype=torch.uint8) for _ in range(tp)]}


def shards(tp: int = 2, pages: int = 8):  # noqa: ANN201
    return leaf_tensors(tensors_of(tp, pages))


def test_keys_and_row_groups_pair_every_block_of_every_shard_in_the_same_order() -> None:
    tensors = tensors_of()
    plan = plan_transfer({"full": [3, 5], "swa": [7]}, {"full": H[:2], "swa": H[2:3]}, leaf_tensors(tensors))
    keys = plan.keys()
    groups = plan.row_groups()
    assert [ids for _, ids in groups] == [[3, 5], [3, 5], [7], [7]]
    rows = [(tensor, block_id) for tensor, ids in groups for block_id in ids]
    assert len(keys) == len(rows) == 6
    for key, (tensor, block_id) in zip(keys, rows):
        assert tensor is tensors[key.leaf][key.shard]
        expected = {H[0]: 3, H[1]: 5, H[2]: 7}[key.hash]
        assert block_id == expected
    assert keys[0] == BlockKey("full", 0, H[0])
    assert plan.nbytes == 2 * (16 + 16) + 1 * (32 + 32)
    assert plan.block_ids() == {"full": [3, 5], "swa": [7]}


def test_the_block_count_is_the_number_of_keys() -> None:
    plan = plan_transfer({"full": [3, 5, 6], "swa": [7, 2]}, {"full": H[:3], "swa": H[2:4]}, shards(tp=3))
    assert plan.block_count == len(plan.keys()) == 3 * 3 + 2 * 3


def test_leaves_with_no_blocks_are_left_out() -> None:
    plan = plan_transfer({"full": [], "swa": [1]}, {"full": [], "swa": H[:1]}, shards())
    assert [run.leaf for run in plan.runs] == ["swa"]
    assert plan_transfer({"full": []}, {"full": []}, shards()).runs == []


def test_numpy_block_ids_and_bytes_like_hashes_are_accepted_as_ints_and_bytes() -> None:
    plan = plan_transfer({"full": np.array([1, 2])}, {"full": [bytearray(H[0]), memoryview(H[1])]}, shards())
    run = plan.runs[0]
    assert run.block_ids == [1, 2] and all(type(i) is int for i in run.block_ids)
    assert run.hashes == H[:2] and all(type(h) is bytes for h in run.hashes)


@pytest.mark.parametrize(("ids", "hashes", "message"), [
    ({"nope": [1]}, {"nope": H[:1]}, "unknown leaf"),
    ({"full": [1, 2]}, {"full": H[:1]}, "2 block ids for 1 hashes"),
    ({"full": [1]}, {}, "1 block ids for 0 hashes"),
    ({"full": [1]}, {"full": [b"short"]}, "8 bytes"),
    ({"full": [1]}, {"full": ["not bytes"]}, "must be bytes"),
    ({"full": [0]}, {"full": H[:1]}, "block id 0 outside 1..7"),
    ({"full": [1, 8]}, {"full": H[:2]}, "block id 8 outside 1..7"),
    ({"full": [3, 1, 3]}, {"full": H[:3]}, "block id 3 appears more than once"),
    ({"full": [1.0]}, {"full": H[:1]}, "must be integers"),
    ({"full": ["1"]}, {"full": H[:1]}, "must be integers"),
])
def test_bad_input_is_a_value_error_naming_what_is_wrong(ids, hashes, message) -> None:
    with pytest.raises(ValueError, match=message):
        plan_transfer(ids, hashes, shards())


def test_a_leaf_s_tensors_are_read_once_for_its_pages_sizes_and_device() -> None:
    leaves = shards(tp=3, pages=8)
    assert leaves["full"].pages == 8 and leaves["full"].row_bytes == 3 * 16 and leaves["swa"].row_bytes == 3 * 32
    assert leaves["full"].device == torch.device("cpu")
    plan = plan_transfer({"full": [1, 2], "swa": [3]}, {"full": H[:2], "swa": H[2:3]}, leaves)
    assert plan.nbytes == 2 * 48 + 96 and plan.block_count == 9 and plan.device == torch.device("cpu")


def test_the_block_ids_are_copied_so_that_the_engine_may_reuse_its_list() -> None:
    ids = [3, 5]
    plan = plan_transfer({"full": ids}, {"full": H[:2]}, shards())
    ids[0] = 7
    assert plan.runs[0].block_ids == [3, 5]


def test_a_subset_keeps_the_leaf_and_its_sizes() -> None:
    run = plan_transfer({"full": [3, 5, 6]}, {"full": H[:3]}, shards()).runs[0]
    part = run.subset([2, 0])
    assert part.block_ids == [6, 3] and part.hashes == [H[2], H[0]]
    assert (part.leaf, part.shards, part.row_bytes, part.device) == (run.leaf, run.shards, run.row_bytes, run.device)


@pytest.mark.parametrize("ids", [
    [1], [1, 2, 3], (7, 1), [1, 1], [0], [8], [-1], [2**70], [True], [1.0], ["1"], [None], np.array([1, 2]),
    [np.int64(1)], list(range(1, 8)), [3, 1, 3], [], "12", {1, 2}, [1, 2, 2**63],
])
def test_the_native_block_id_check_answers_as_its_python_twin(ids) -> None:
    assert plain_block_ids(ids, 8) == plain_block_ids_python(ids, 8)


def test_the_native_block_id_check_finds_repeats_in_long_runs() -> None:
    many = list(range(1, 5000))
    assert plain_block_ids(many, 5000) == many and plain_block_ids(many, 5000) is not many
    assert plain_block_ids(many + [4321], 5000) is None
    assert plain_block_ids_python(many + [4321], 5000) is None
    spread = [i * 4096 + 1 for i in range(300)]  # ids that share low bits
    assert plain_block_ids(spread, 1 << 30) == spread
    assert plain_block_ids(spread + [spread[123]], 1 << 30) is None


def test_the_native_block_id_check_is_built() -> None:
    assert plain_block_ids is not plain_block_ids_python, "dkv._hash_check was not built (no C compiler?)"
