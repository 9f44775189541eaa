"""The sampler's normaliser does not depend on torch's thread count (a prefill and a decode worker
may run different counts); torch's own sum of a long row does."""
import torch

from cluster.engine.sampler import ordered_sum


def test_ordered_sum_is_the_same_at_every_thread_count():
    g = torch.Generator().manual_seed(0)
    previous = torch.get_num_threads()
    plain_varied = 0
    try:
        for _ in range(10):
            x = torch.rand(151936, generator=g) * torch.rand(1, generator=g) ** 8   # a Qwen-size vocabulary
            ours, theirs = set(), set()
            for threads in (1, 3, 4):
                torch.set_num_threads(threads)
                ours.add(ordered_sum(x).item())
                theirs.add(x.sum().item())
            assert len(ours) == 1
            plain_varied += len(theirs) > 1
            torch.testing.assert_close(ordered_sum(x), x.double().sum().float())
    finally:
        torch.set_num_threads(previous)
    assert plain_varied   # what the ordered sum is for: torch's split reduction rounds by thread count
