"""Gradient buckets: started in order from autograd hooks during backward, into buffers the
``.grad`` tensors are views of; the reduced gradient is where the optimizer reads it."""

import pytest
import torch

from phalanx.train.grad_buckets import GradientBuckets


class RecordingExchange:
    """Sums like a quorum of ``world`` identical ranks would, and records what started when."""

    def __init__(self, world=2):
        self.world, self.started = world, []

    def launch(self, tensor, share=1.0):
        self.started.append((tensor.data_ptr(), tensor.numel(), round(share, 6)))
        tensor.mul_(self.world)  # the sum over identical ranks


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _loss(m):
    torch.manual_seed(1)
    return m(torch.randn(5, 8)).pow(2).mean()


def test_buckets_start_during_backward_in_order_and_grads_are_their_views():
    ref = _model()
    _loss(ref).backward()
    m = _model()
    b = GradientBuckets(list(m.parameters()), bucket_bytes=4 * 300)  # several buckets
    assert len(b.buckets) >= 3
    ex = RecordingExchange(world=2)
    b.arm(ex, share=0.5)
    _loss(m).backward()
    # every bucket but the last left during backward; the last (no hooks) leaves in finish()
    assert len(ex.started) == len(b.buckets) - 1
    assert b.finish() == ""
    assert [s[0] for s in ex.started] == [bk.flat.data_ptr() for bk in b.buckets]  # in index order
    for p, q in zip(m.parameters(), ref.parameters()):
        # share 0.5 summed over 2 identical ranks: the plain gradient
        assert torch.allclose(p.grad, q.grad, atol=1e-7)
        assert any(p.grad.data_ptr() == v.data_ptr() for bk in b.buckets for v in bk.views)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_later_steps_reuse_the_buckets_whatever_zero_grad_does(set_to_none):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    b = GradientBuckets(list(m.parameters()), bucket_bytes=4 * 300)
    flats = [bk.flat.data_ptr() for bk in b.buckets]
    for _ in range(3):
        ex = RecordingExchange(world=1)
        b.arm(ex, share=1.0)
        _loss(m).backward()
        b.finish()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        _loss(ref).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert [s[0] for s in ex.started] == flats  # the same memory every step
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_a_second_backward_into_a_bucket_already_sent_is_refused_not_silently_summed():
    m = _model()
    b = GradientBuckets(list(m.parameters()), bucket_bytes=4 * 300)  # several buckets
    b.arm(RecordingExchange(), share=1.0)
    _loss(m).backward()
    _loss(m).backward()
    assert "gradient arrived twice" in b.finish()


def test_a_second_backward_before_the_one_bucket_leaves_is_summed_as_torch_would():
    """One bucket (the default size, a small model) leaves only in finish(), after backward: a
    second backward adds into it, exactly as plain torch accumulates, and nothing is lost."""
    ref = _model()
    _loss(ref).backward()
    _loss(ref).backward()
    m = _model()
    b = GradientBuckets(list(m.parameters()))
    assert len(b.buckets) == 1
    ex = RecordingExchange(world=1)
    b.arm(ex, share=1.0)
    _loss(m).backward()
    _loss(m).backward()
    assert ex.started == [] and b.finish() == ""
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7)


def test_unused_parameters_contribute_zeros_and_their_bucket_still_starts():
    m = _model()
    extra = torch.nn.Linear(3, 3)  # never used in the forward pass
    b = GradientBuckets(list(m.parameters()) + list(extra.parameters()), bucket_bytes=1 << 20)
    ex = RecordingExchange(world=1)
    b.arm(ex, share=1.0)
    _loss(m).backward()
    assert ex.started == []  # the one bucket waits for the unused parameters' gradients
    b.finish()
    assert len(ex.started) == 1 and torch.count_nonzero(extra.weight.grad) == 0


def test_after_a_step_that_did_not_commit_the_buckets_get_fresh_memory():
    m = _model()
    b = GradientBuckets(list(m.parameters()))
    old = [bk.flat for bk in b.buckets]
    b.renew()
    assert all(o.data_ptr() != bk.flat.data_ptr() for o, bk in zip(old, b.buckets))
    assert all(p.grad is None for p in m.parameters())
    ex = RecordingExchange(world=1)
    b.arm(ex, share=1.0)
    _loss(m).backward()
    b.finish()
    assert [s[0] for s in ex.started] == [bk.flat.data_ptr() for bk in b.buckets]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_last_bucket_carries_the_tail_unscaled_and_waits_for_it(set_to_none):
    """One collective fewer a step: the last bucket has room for the tail, the hooks leave it for
    finish() (the tail is filled first), its gradients are scaled and its tail is not."""
    ref = _model()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    b = GradientBuckets(list(m.parameters()), bucket_bytes=4 * 300)
    for step in range(2):  # the room is made once, then reused
        opt.zero_grad(set_to_none=set_to_none)
        ref.zero_grad()
        _loss(ref).backward()
        ex = RecordingExchange(world=2)
        b.arm(ex, share=0.5, tail_size=3)
        _loss(m).backward()
        assert len(ex.started) == len(b.buckets) - 1  # the last waits for its tail
        tail = b.tail_view()
        tail.copy_(torch.tensor([1.0, 2.0, 0.25]))  # coverage 1, 2; loss * share 0.25
        assert b.finish() == ""
        last = b.buckets[-1]
        assert ex.started[-1] == (last.flat.data_ptr(), last.numel + 3, round(last.numel / b.total_numel, 6))
        assert tail.tolist() == [2.0, 4.0, 0.5]  # summed over 2 ranks, never scaled by the share
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-7)


def test_a_bucket_of_half_precision_does_not_carry_the_tail():
    m = _model().half()
    b = GradientBuckets(list(m.parameters()))
    b.arm(RecordingExchange(), share=1.0, tail_size=5)
    assert b.tail_view() is None and b.buckets[-1].flat.numel() == b.buckets[-1].numel
