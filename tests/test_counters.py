"""The suite's op counter (``tests/counters.py``) counts what it is asked to, and can fail."""

import pytest
import torch

from counters import DATA_SIZED_OPS, EXPLICIT_SYNCS, OpCounter, all_ops, host_syncs, matmul_rows, op_calls


def test_host_syncs_count_explicit_reads_and_data_sized_outputs(count_host_syncs):
    with count_host_syncs() as counter:
        torch.ones(3).sum().item()
        torch.nonzero(torch.ones(3))
        torch.ones(3).masked_select(torch.ones(3) > 0)
        torch.ones(3).add(1)  # not a sync
    assert counter.count == 3 and counter.names == ["_local_scalar_dense", "nonzero", "masked_select"]
    assert counter.of(*EXPLICIT_SYNCS) == 1 and counter.of(*DATA_SIZED_OPS) == 2


def test_ops_match_by_overload_packet_or_name(op_counter):
    with op_counter(torch.ops.aten.scatter, "aten::topk") as counter:
        z = torch.randn(4, 6)
        torch.zeros_like(z).scatter(1, z.topk(2).indices, 1.0)  # scatter.value
        torch.zeros_like(z).scatter(1, z.topk(2).indices, z)  # scatter.src
    assert counter.by_name == {"scatter": 2, "topk": 2}
    with op_calls(torch.ops.aten.scatter.src) as exact:  # one overload only
        torch.zeros_like(z).scatter(1, z.topk(2).indices, 1.0)
        torch.zeros_like(z).scatter(1, z.topk(2).indices, z)
    assert exact.count == 1


def test_where_filters_and_measure_values():
    with OpCounter(torch.ops.aten._softmax.default, where=lambda func, args, kwargs: args[0].shape[-1] == 8) as c:
        torch.softmax(torch.randn(3, 8), -1)
        torch.softmax(torch.randn(3, 4), -1)
    assert c.count == 1
    with matmul_rows() as rows:
        torch.randn(5, 3) @ torch.randn(3, 4)
        torch.bmm(torch.randn(7, 2, 3), torch.randn(7, 3, 1))
    assert rows.values == [("mm", 5), ("bmm", 7)] and rows.total == 12


def test_all_ops_sees_every_op():
    with all_ops() as counter:
        torch.ones(3).add(1)
    assert counter.names == ["ones", "add"]


def test_fail_raises_at_the_first_counted_op():
    with pytest.raises(AssertionError, match="_local_scalar_dense"), host_syncs(fail=True) as counter:
        torch.ones(3).sum().item()
    assert counter.count == 1
