"""The pre-plan race, provoked on a CPU with a deferred copy engine standing in for the GPU's
DMA queue: plan(N+1) runs before step N's host-to-device copies have executed."""

import pytest

from mstar_core import KVSpan, KVStep, Step, StepContext

from .helpers import small_kv


class DeferredGPU:
    """One stream: copies and replays are queued in order and run later; a copy reads its
    source when it runs (like an async H2D from pinned memory). A fence waits until the queue
    has run up to its record point."""

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


def positions_seen(slots, fences):
    kv = small_kv(max_pages=32, page_size=4)
    kv.build_accelerator_graph_buffers(slots, 4, 64)
    gpu = DeferredGPU()
    st = kv._staging
    st.copy = gpu.copy
    st.fences = [gpu.fence(fences) for _ in range(slots)]
    for r in "ab":
        kv.ingest_request(r)
    seen = []
    for n in range(4):  # the host runs ahead: four steps planned before the GPU runs them
        step = Step(KVStep((KVSpan("a", "t", 1), KVSpan("b", "t", 1))))
        ctx = StepContext(slot=n % slots, bucket=4)
        assert kv.admit(step, ctx)
        lay = kv.plan(step, ctx).layout("t")
        kv.commit(step, ctx)
        want = [s.length - 1 for s in lay.spans]
        # the replay of step n, queued behind its copies, reads its slot's static buffer
        gpu.enqueue(lambda p=lay.positions, w=want: seen.append((p[:2].tolist(), w)))
    gpu.run_until(len(gpu.queue))
    return seen


def test_double_buffered_slots_with_fences_never_corrupt_a_step():
    for got, want in positions_seen(slots=2, fences=True):
        assert got == want


def test_one_slot_with_fence_serialises_and_stays_correct():
    for got, want in positions_seen(slots=1, fences=True):
        assert got == want


def test_the_race_is_real_without_the_mechanism():
    """Control: one slot, no fence. Step 0's copy runs after plan(3) overwrote the staging
    buffer, so step 0 would attend at step 3's positions. The test above can fail."""
    seen = positions_seen(slots=1, fences=False)
    assert any(got != want for got, want in seen)
    assert seen[0][0] == seen[3][1]  # step 0 reads step 3's positions
