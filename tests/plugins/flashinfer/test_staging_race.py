"""The pre-plan race, provoked on a CPU with a deferred copy engine standing in for the GPU's
DMA queue: plan N+1 stages its host arrays before step N's host-to-device copy has executed.
The FlashInfer wrappers stage through :class:`mstar_flashinfer.staging.Staging`. (The KV manager's
page table copies from fresh tensors of torch's caching host allocator, which holds each one
until its copy has run: page_table.py.)"""

import torch

from mstar_flashinfer.staging import Staging


class DeferredGPU:
    """One stream: copies and reads are queued in order and run later; a copy reads its source
    when it runs (like an async H2D from pinned memory). A fence waits until the queue has run
    up to its record point."""

    def __init__(self):
        self.queue = []
        self.done = 0

    def copy(self, dst, src):
        self.queue.append(lambda: dst.copy_(src))

    def enqueue(self, op):
        self.queue.append(op)

    def run_until(self, n):
        while self.done < n:
            self.queue[self.done]()
            self.done += 1

    def fence(self, enabled):
        gpu = self

        class F:
            mark = 0

            def record(self):
                self.mark = len(gpu.queue)

            def wait(self):
                if enabled:
                    gpu.run_until(self.mark)

        return F()


def staged_seen(slots, fences, plans=4):
    """The host stages ``plans`` arrays (plan n stages n, n, n) before the GPU runs anything;
    returns what each plan's device copy held when its step read it, and what it should hold."""
    gpu = DeferredGPU()
    st = Staging(torch.device("cpu"), slots)
    st.copy = gpu.copy
    st._fences = [gpu.fence(fences) for _ in range(slots)]
    seen = []
    for n in range(plans):
        st.begin()
        dev = torch.empty(3, dtype=torch.int32)
        st.copy(dev, st.put("rows", torch.full((3,), n, dtype=torch.int32)))
        st.end()
        gpu.enqueue(lambda d=dev, n=n: seen.append((d.tolist(), [n] * 3)))  # step n reads its copy
    gpu.run_until(len(gpu.queue))
    return seen


def test_double_buffered_slots_with_fences_never_corrupt_a_step():
    for got, want in staged_seen(slots=2, fences=True):
        assert got == want


def test_one_slot_with_fence_serialises_and_stays_correct():
    for got, want in staged_seen(slots=1, fences=True):
        assert got == want


def test_the_race_is_real_without_the_mechanism():
    """Control: one slot, no fence. Step 0's copy runs after plan 3 overwrote the staging
    buffer, so step 0 would read step 3's arrays. The tests above can fail."""
    seen = staged_seen(slots=1, fences=False)
    assert any(got != want for got, want in seen)
    assert seen[0][0] == seen[3][1]  # step 0 reads step 3's arrays
