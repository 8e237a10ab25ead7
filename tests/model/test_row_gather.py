"""row_gather.gather_rows: rows picked by index, a row's copies' gradients added in float32 and rounded
once (plain indexing adds them in the tensor's dtype, rounding at every addition in bf16)."""

import torch

from spmd_rl.model.row_gather import gather_rows


def test_a_rows_copies_add_their_gradients_in_float32():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g).to(torch.bfloat16).requires_grad_()
    index = torch.tensor([0, 1] * 64 + [3])  # rows 0 and 1 read 64 times each, row 2 never
    grad = torch.randn(len(index), 8, generator=g).to(torch.bfloat16)
    (got,) = torch.autograd.grad(gather_rows(x, index), x, grad)
    want = torch.zeros(4, 8).index_add_(0, index, grad.float()).to(torch.bfloat16)  # float32 sums, one rounding
    assert torch.equal(got, want)
    assert (got[2] == 0).all()
    torch.testing.assert_close(gather_rows(x, index), x[index], rtol=0, atol=0)
    (plain,) = torch.autograd.grad(x[index], x, grad)  # bf16 additions: not the float32 sum
    assert not torch.equal(plain, want)


def test_float64_stays_float64_and_no_graph_is_plain_indexing():
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([2, 2, 0])
    (got,) = torch.autograd.grad(gather_rows(x, index).sum(), x)
    assert got.dtype == torch.float64 and got[:, 0].tolist() == [1.0, 0.0, 2.0]
    with torch.no_grad():
        assert not gather_rows(x, index).requires_grad
