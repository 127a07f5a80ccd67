"""Adaptive scheduling on the scheduler alone, with a fake step-time model (and, where time matters, a fake
clock that each step advances by its cost): TPOT-bounded steps, the batch growing and shrinking, TTFT
admission control and its online calibration, user priorities, prefix-aware admission with bounded
waiting, and exactly today's schedules when none of it is asked for."""

import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hfaccel import EngineConfig
from hfaccel.engine.block_manager import BlockManager
from hfaccel.engine.cost_model import StepCostModel
from hfaccel.engine.latency import MAX_STEP_TARGETS, MEAN_HEADROOM
from hfaccel.engine.request import Request, StoppingParams
from hfaccel.engine.scheduler import Scheduler
from tests.engine.schedule_workloads import CONFIGS, record

RECORDED = json.loads((pathlib.Path(__file__).parent / "data" / "schedules_before_adaptive.json").read_text())


class FakeFit:
    def __init__(self, c0, c1, c2, c3=0.0):
        self.coefficients = (c0, c1, c2, c3)

    def predict(self, decode_seqs, prefill_tokens, kv_tokens):
        c0, c1, c2, c3 = self.coefficients
        return c0 + c1 * decode_seqs + c2 * prefill_tokens + c3 * kv_tokens


class FakeCostModel:
    """10 ms a step, 1 ms per decoding sequence, 0.1 ms per prefill token (unless told otherwise)."""

    def __init__(self, *coefficients):
        self.current = FakeFit(*(coefficients or (0.010, 0.001, 0.0001)))

    def fit(self):
        return self.current

    def predict_decode(self, decode_seqs, kv_tokens):
        return self.current.predict(decode_seqs, 0, kv_tokens)

    largest_decode_seen = 1 << 20  # the line is the world here: no doubling needed


def make(rid, prompt_len, max_new=4, token=5, **fields):
    request = Request(rid, [token] * prompt_len, StoppingParams(max_new_tokens=max_new))
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def scheduler(num_blocks=512, block_size=4, prefix=False, cost_model=None, **config):
    config.setdefault("max_num_batched_tokens", 512)
    config.setdefault("max_num_seqs", 64)
    engine_config = EngineConfig(block_size=block_size, enable_prefix_caching=prefix, **config)
    return Scheduler(BlockManager(num_blocks, block_size, prefix), engine_config, 4096, cost_model)


def run_step(sched):
    step = sched.schedule(True)
    sampled = [r for r, n in zip(step.requests, step.num_tokens) if r.num_computed_tokens + n == r.num_tokens]
    sched.update(step, sampled, [7] * len(sampled))
    return step


def predicted(step, fit):
    decodes = sum(1 for n in step.num_tokens if n == 1)
    kv = sum(r.num_computed_tokens for r in step.requests)  # after update: the step's context lengths
    return fit.predict(decodes, step.total_tokens - decodes, kv)


class FakeClock:
    def __init__(self, start=100.0):
        self.now = start

    def __call__(self):
        return self.now


def timed(sched, start=100.0):
    """Give `sched` a fake clock (returned) that `run_timed_step` advances."""
    sched.clock = FakeClock(start)
    return sched.clock


def add_at(sched, request):
    """Queue `request` as arriving now (by the scheduler's clock)."""
    request.metrics.arrival_time = sched.clock()
    sched.add(request)
    return request


def run_timed_step(sched, fit, speed=1.0):
    """One step that takes `speed` x what `fit` predicts for it (the world may be faster or slower than
    the model), on the scheduler's fake clock; returns (step, seconds)."""
    step = sched.schedule(False)
    sched.take_rejected()
    decodes = sum(1 for n in step.num_tokens if n == 1)
    kv = sum(r.num_computed_tokens + n for r, n in zip(step.requests, step.num_tokens))
    seconds = speed * fit.predict(decodes, step.total_tokens - decodes, kv) if step.requests else 0.0
    sched.clock.now += seconds
    sampled = [r for r, n in zip(step.requests, step.num_tokens) if r.num_computed_tokens + n == r.num_tokens]
    sched.update(step, sampled, [7] * len(sampled))
    return step, seconds


# ----------------------------------------------------------------- no target: exactly today's schedules


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_without_targets_the_schedule_is_exactly_the_recorded_one(key):
    name, seed = key.split("/")
    expected = [[tuple(pair) for pair in step] for step in RECORDED[key]]
    assert record(Scheduler, name, int(seed)) == expected
    # A ready step-time model changes nothing while no request has a target.
    assert record(Scheduler, name, int(seed), cost_model=FakeCostModel()) == expected


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_target_without_a_ready_model_changes_nothing(name):
    expected = [[tuple(pair) for pair in step] for step in RECORDED[f"{name}/0"]]
    assert record(Scheduler, name, 0, tpot_target_ms=1.0, ttft_target_ms=1e9) == expected


# ----------------------------------------------------------------- TPOT target


def test_the_mean_time_per_output_token_stays_within_the_target_and_chunks_follow_the_budget():
    model = FakeCostModel()
    sched = scheduler(cost_model=model, tpot_target_ms=50)
    clock = timed(sched)
    requests = [add_at(sched, make(i, 300 if i % 3 == 0 else 40, max_new=30)) for i in range(60)]
    steps = []
    block_cost = 4 * 0.0001  # the first chunk of a step may take one block whatever the time left
    while sched.has_unfinished():
        step, seconds = run_timed_step(sched, model.current)
        steps.append((step, seconds, sched._time))
        if sched._time is not None:  # a TPOT clock is running: the step keeps within what it allows
            assert seconds <= max(sched._time.limit, 0.010 + 0.001 * len(step)) + block_cost + 1e-9
            assert seconds <= MAX_STEP_TARGETS * 0.050 + block_cost + 1e-9
        assert len(steps) < 5000
    assert all(r.finish_reason == "length" for r in requests)
    # A TPOT is a mean: every request keeps it within the target, with the headroom.
    assert max(r.metrics.tpot_s for r in requests) <= MEAN_HEADROOM * 0.050 + 1e-9
    assert clock.now > 100.0
    # SplitFuse: the prompt chunks of a step fill the time its running requests allow, which is more
    # than a single step's share of the target once pure-decode steps have saved time (a mean, not a
    # cap per step).
    mixed = [(st, sec, b) for st, sec, b in steps if b is not None and any(n > 1 for n in st.num_tokens)]
    assert mixed
    for step, seconds, budget in mixed:
        assert (
            seconds <= budget.limit + block_cost + 1e-9 or seconds <= 0.010 + 0.001 * len(step) + block_cost
        )
    assert max(seconds for _, seconds, _ in mixed) > 0.050, "no step spent the time earlier steps saved"


def test_a_step_spends_only_the_time_earlier_steps_saved():
    """A request decoding alone in 11 ms steps (target 50 ms) saves about 36 ms a step; a prompt arriving
    then gets a chunk as long as that saving allows (at most `MAX_STEP_TARGETS` targets), and the
    request's mean stays within the target."""
    model = FakeCostModel()
    sched = scheduler(cost_model=model, tpot_target_ms=50, max_num_batched_tokens=4096)
    timed(sched)
    alone = add_at(sched, make("alone", 8, max_new=40))
    for _ in range(2):
        run_timed_step(sched, model.current)
    assert len(alone.output_token_ids) == 2
    allowance = MEAN_HEADROOM * 0.050 * 2 - (sched.clock() - alone.metrics.token_times[0])
    assert 0.050 < allowance < MAX_STEP_TARGETS * 0.050
    add_at(sched, make("long", 2000, max_new=2))
    step, seconds = run_timed_step(sched, model.current)
    chunk = dict(zip((r.request_id for r in step.requests), step.num_tokens))["long"]
    # The saving went to the chunk (in whole blocks): far more than a 50 ms step would hold.
    assert seconds <= allowance + 1e-9
    assert chunk >= (allowance - 0.011) / 0.0001 - 4
    assert chunk > (0.050 - 0.011) / 0.0001
    while sched.has_unfinished():
        run_timed_step(sched, model.current)
    assert alone.metrics.tpot_s <= MEAN_HEADROOM * 0.050 + 1e-9


def test_the_batch_grows_under_a_deep_queue_and_shrinks_when_the_target_tightens():
    model = FakeCostModel()
    sched = scheduler(num_blocks=4096, cost_model=model, tpot_target_ms=50)  # room for every request
    requests = [make(i, 8, max_new=200) for i in range(80)]
    for r in requests:
        sched.add(r)
    sizes = [len(run_step(sched)) for _ in range(40)]
    grown = max(sizes)
    # 42.5 ms (0.85 x 50): 10 ms + 1 ms per decode -> up to 32 sequences (the default cap would be 64).
    assert 28 <= grown <= 32
    preemptions = sched.num_preemptions
    sched.config = sched.config.with_overrides(tpot_target_ms=20)  # the target tightens
    for request in sched.running:
        assert not request.is_finished
    running, waiting = [], []
    while sched.has_unfinished():
        run_step(sched)
        running.append(len(sched.running))
        waiting.append(len(sched.waiting))
    assert sched.num_preemptions == preemptions, "shrinking never preempts"
    # Nobody new joins until the batch fits 17 ms (10 ms + 7 decodes); then it stays there while the
    # queue is still deep.
    small = running.index(next(n for n in running if n <= 7))
    assert waiting[small] > 0, "the batch shrank while requests were still waiting"
    assert max(running[small:]) <= 7
    assert running[0] > 8


def cpu_step_seconds(decodes, prefill_tokens, kv_tokens):
    """A CPU's step: one row is a matrix-vector product (40 ms); any more rows a matrix product (70 ms
    and 1 ms a sequence, 0.1 ms a prompt token)."""
    if decodes + prefill_tokens <= 1:
        return 0.040
    return 0.070 + 0.001 * decodes + 0.0001 * prefill_tokens


def test_the_batch_grows_past_a_cheap_one_row_step():
    """The step-time model that learns a one-row step apart (a table by batch size, a line on the
    steps of more rows) lets the batch grow to what the target allows: 85 ms (0.85 x 100) is 15
    sequences here (16 admitted is a fit's error), where a line through one- and two-row steps prices
    each sequence at 31 ms and stops the batch at two. Every request keeps its TPOT."""
    model = StepCostModel(min_samples=12)
    for _ in range(3):  # a lone request was served before: its prompt, then one-row decodes
        model.observe(0, 40, 40, cpu_step_seconds(0, 40, 40))
        for i in range(8):
            model.observe(1, 0, 41 + i, cpu_step_seconds(1, 0, 41 + i))
    sched = scheduler(num_blocks=4096, cost_model=model, tpot_target_ms=100)
    clock = timed(sched)
    requests = [add_at(sched, make(i, 8, max_new=40)) for i in range(40)]
    sizes = []
    while sched.has_unfinished():
        step = sched.schedule(False)
        decodes = sum(1 for n in step.num_tokens if n == 1)
        kv = sum(r.num_computed_tokens + n for r, n in zip(step.requests, step.num_tokens))
        seconds = cpu_step_seconds(decodes, step.total_tokens - decodes, kv)
        clock.now += seconds
        model.observe(decodes, step.total_tokens - decodes, kv, seconds)
        sampled = [
            r for r, n in zip(step.requests, step.num_tokens) if r.num_computed_tokens + n == r.num_tokens
        ]
        sched.update(step, sampled, [7] * len(sampled))
        sizes.append(decodes)
    assert 12 <= max(sizes) <= 16  # 15 by the world; the line is a fit
    assert model.predict_decode(1, 50) == pytest.approx(0.040)
    for request in requests:
        times = request.metrics.token_times
        assert (times[-1] - times[0]) / (len(times) - 1) <= 0.100


def test_a_per_request_tpot_target_bounds_the_batch_it_joins():
    sched = scheduler(cost_model=FakeCostModel())
    for i in range(20):
        sched.add(make(i, 4, max_new=50))
    sched.add(make("tight", 4, max_new=50, tpot_target_ms=20))
    sizes = [len(run_step(sched)) for _ in range(5)]
    # Without a target all 21 join; the tight one must wait for a batch of at most 8 sequences.
    assert max(sizes) == 20
    assert all(r.request_id != "tight" for r in sched.running)


# ----------------------------------------------------------------- TTFT admission control


@pytest.mark.parametrize("mode", ["reject", "warn"])
def test_a_request_that_cannot_meet_its_ttft_target_is_told_at_once(mode):
    # 100 ms per prefill token step: a 200-token prompt behind 10 others cannot start within 150 ms.
    sched = scheduler(
        cost_model=FakeCostModel(0.050, 0.001, 0.001), admission=mode, max_num_batched_tokens=64
    )
    for i in range(10):
        sched.add(make(i, 200, max_new=10))
    late = make("late", 200, max_new=10, ttft_target_ms=150)
    sched.add(late)
    easy = make("easy", 4, max_new=2, ttft_target_ms=1e7)
    sched.add(easy)
    if mode == "reject":
        assert late.finish_reason == "rejected" and "TTFT target 150 ms cannot be met" in late.rejected_reason
        assert late not in sched.waiting and sched.num_rejected == 1
    else:
        assert late.finish_reason is None and late in sched.waiting
        assert "cannot be met" in late.warnings[0]
    assert easy.finish_reason is None and easy in sched.waiting


def test_a_request_whose_deadline_passes_in_the_queue_is_rejected_by_the_next_step():
    sched = scheduler(cost_model=FakeCostModel(), admission="reject", max_num_seqs=1)
    sched.add(make("running", 4, max_new=50))
    run_step(sched)
    waiting = make("waiting", 4, max_new=2, ttft_target_ms=10_000)
    sched.add(waiting)
    assert waiting in sched.waiting
    waiting.metrics.arrival_time -= 20.0  # as if it had waited 20 s
    run_step(sched)
    assert waiting.finish_reason == "rejected" and "deadline passed" in waiting.rejected_reason
    assert sched.take_rejected() == [waiting] and sched.take_rejected() == []
    assert id(waiting) not in sched.live


# ----------------------------------------------------------------- TTFT estimate calibrated online


def bursts(speed, ttft_target_ms, calibrate=True, count=12, size=4, prompt_len=100):
    """`count` bursts of `size` requests arriving together, 1 s apart (each burst done before the next),
    in a world whose steps take `speed` x what the step-time model predicts. Returns per burst the
    requests and, for each, the TTFT estimated at arrival (None: no estimate)."""
    model = FakeCostModel()
    sched = scheduler(cost_model=model, ttft_target_ms=ttft_target_ms, admission="reject")
    if not calibrate:
        sched.ttft_calibration.min_samples = 10**9
    timed(sched)
    out = []
    for b in range(count):
        sched.clock.now = 100.0 + b
        burst, estimates = [], []
        for i in range(size):
            request = make(f"{b}.{i}", prompt_len, max_new=4, token=10 + b * size + i)
            request.metrics.arrival_time = sched.clock()
            estimates.append(sched.estimate_ttft(request))
            sched.add(request)
            burst.append(request)
        while sched.has_unfinished():
            run_timed_step(sched, model.current, speed)
        out.append((burst, estimates))
    return out, sched


def met(request, target_s):
    return request.finish_reason == "length" and request.metrics.ttft_s <= target_s + 1e-12


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_ttft_estimates_converge_to_the_observed_ttfts(speed):
    # One request at a time: the model's TTFT picture is exact up to the world's speed, which the
    # calibration learns (the ratio observed / estimated) from the requests that started.
    out, sched = bursts(speed, ttft_target_ms=1e6, size=1, count=8)
    observed = [burst[0].metrics.ttft_s for burst, _ in out]
    estimated = [estimates[0] for _, estimates in out]
    assert estimated[0] == pytest.approx(observed[0] / speed)  # uncalibrated: off by the speed
    assert sched.ttft_calibration.factor == pytest.approx(speed)
    for est, obs in list(zip(estimated, observed))[sched.ttft_calibration.min_samples :]:
        assert est == pytest.approx(obs, rel=1e-6)


def test_no_over_rejection_once_calibrated():
    # The world runs at 0.4x the model's step times: the raw estimate (20, 30, 40, 50 ms for the four
    # requests of a burst) rejects the last two against a 36 ms target, although all four would start
    # within 20 ms (one step of 400 prompt tokens).
    target = 0.036
    raw, _ = bursts(0.4, ttft_target_ms=36, calibrate=False)
    assert all(sum(r.finish_reason == "rejected" for r in burst) == 2 for burst, _ in raw)
    assert all(met(r, target) for burst, _ in raw for r in burst if r.finish_reason != "rejected")
    calibrated, sched = bursts(0.4, ttft_target_ms=36)
    assert sched.ttft_calibration.factor < 0.8
    for burst, _ in calibrated[2:]:  # once the calibration has its samples: every request served in time
        assert all(met(r, target) for r in burst)
    assert sum(met(r, target) for burst, _ in calibrated for r in burst) >= 44


def test_calibration_rejects_what_would_miss_when_the_world_is_slower():
    # At 2.5x the model's step times the raw estimate admits all four requests of a burst and every one
    # misses an 80 ms target (one step of 400 tokens takes 125 ms). Calibrated, the scheduler admits what
    # can start in time (one or two requests: 50 or 75 ms) and rejects the rest at once.
    target = 0.080
    raw, _ = bursts(2.5, ttft_target_ms=80, calibrate=False)
    assert all(r.finish_reason == "length" and not met(r, target) for burst, _ in raw for r in burst)
    calibrated, sched = bursts(2.5, ttft_target_ms=80)
    assert sched.ttft_calibration.factor > 2.0
    for burst, _ in calibrated[2:]:
        served = [r for r in burst if r.finish_reason != "rejected"]
        assert served and all(met(r, target) for r in served)
    assert sum(met(r, target) for burst, _ in calibrated for r in burst) >= 10


def test_a_deadline_passed_in_the_queue_teaches_the_calibration_a_lower_bound():
    sched = scheduler(cost_model=FakeCostModel(), admission="reject", max_num_seqs=1, ttft_target_ms=500)
    timed(sched)
    add_at(sched, make("running", 4, max_new=50))
    run_timed_step(sched, sched.cost_model.current)
    waiting = add_at(sched, make("waiting", 4, max_new=2))
    assert id(waiting) in sched.latency._ttft_predicted
    sched.clock.now += 0.6  # waited past its deadline without a seat
    run_timed_step(sched, sched.cost_model.current)
    assert waiting.finish_reason == "rejected"
    started, late = sched.ttft_calibration.ratios()  # the running request's, then the late one's bound
    assert started == pytest.approx(1.0)
    assert late > 1.0 and id(waiting) not in sched.latency._ttft_predicted


@pytest.mark.parametrize("waited, served", [(0.440, True), (0.480, False)])
def test_a_request_that_can_no_longer_start_in_time_is_rejected_before_any_work(waited, served):
    # Its own 300-token prompt takes one 40 ms step (10 ms + 0.1 ms a token): after 440 ms in the queue it
    # still makes a 500 ms target; after 480 ms it cannot, and is rejected instead of computed.
    sched = scheduler(cost_model=FakeCostModel(), admission="reject", max_num_seqs=1, ttft_target_ms=500)
    timed(sched)
    first = add_at(sched, make("first", 4, max_new=2))
    late = add_at(sched, make("late", 300, max_new=2, token=9))
    run_timed_step(sched, sched.cost_model.current)
    late.metrics.arrival_time = sched.clock() - waited
    while not first.is_finished:
        run_timed_step(sched, sched.cost_model.current)
    late.metrics.arrival_time = sched.clock() - waited
    step, _ = run_timed_step(sched, sched.cost_model.current)
    if served:
        assert step.requests == [late] and late.metrics.ttft_s <= 0.500
    else:
        assert not step.requests and late.finish_reason == "rejected"
        assert "prompt would start after" in late.rejected_reason and id(late) not in sched.live
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


# ----------------------------------------------------------------- user priority


def test_user_priority_orders_admission_fcfs_within_a_level():
    sched = scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make(f"low{i}", 4, max_new=3, user_priority=5))
    for i in range(3):
        sched.add(make(f"high{i}", 4, max_new=3, user_priority=-1))
    order = []
    while sched.has_unfinished():
        step = run_step(sched)
        order += [r.request_id for r, n in zip(step.requests, step.num_tokens) if n > 1]
    assert order == ["high0", "high1", "high2", "low0", "low1", "low2"]


def test_the_engine_priority_for_no_starvation_is_untouched_by_user_priority():
    # A preempted request resumes before any waiting one, whatever their user priorities.
    sched = scheduler(num_blocks=8, max_num_seqs=4, max_num_batched_tokens=32)
    requests = [make(i, 5, max_new=8, user_priority=-i) for i in range(4)]
    for r in requests:
        sched.add(r)
    while sched.has_unfinished():
        run_step(sched)
    assert all(r.output_token_ids == [7] * 8 for r in requests)
    assert max(r.num_preemptions for r in requests) <= 1


# ----------------------------------------------------------------- prefix-aware admission


def test_prefix_aware_admission_prefers_the_longest_cached_prefix():
    sched = scheduler(prefix=True, prefix_aware_admission=True, max_num_seqs=1)
    system = list(range(10, 34))  # 6 blocks
    first = Request("first", system + [99], StoppingParams(max_new_tokens=1))
    sched.add(first)
    while sched.has_unfinished():
        run_step(sched)
    cold = Request("cold", list(range(60, 90)), StoppingParams(max_new_tokens=1))
    warm = Request("warm", system + [98, 97], StoppingParams(max_new_tokens=1))
    sched.add(cold)
    sched.add(warm)
    step = sched.schedule(True)
    assert [r.request_id for r in step.requests] == ["warm"] and warm.num_cached_prompt_tokens == 24


def test_requests_sharing_an_uncached_prefix_wait_for_it_to_be_computed_once():
    sched = scheduler(prefix=True, prefix_aware_admission=True, max_num_batched_tokens=8)
    system = list(range(10, 42))  # 8 blocks, computed over 4 steps of 8 tokens
    a = Request("a", system + [1], StoppingParams(max_new_tokens=1))
    sched.add(a)
    run_step(sched)
    b = Request("b", system + [2], StoppingParams(max_new_tokens=1))
    sched.add(b)
    while not b.num_computed_tokens:
        run_step(sched)
    assert b.num_cached_prompt_tokens == 32  # all of the shared prefix, computed once by a
    assert sched.block_manager.stats.hit_tokens == 32


@settings(max_examples=60, deadline=None)
@given(
    workload=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 3), st.integers(1, 12), st.integers(1, 10)),
        min_size=2,
        max_size=24,
    ),
    limit=st.integers(1, 4),
    max_num_seqs=st.integers(1, 4),
    num_blocks=st.integers(12, 30),
)
def test_prefix_aware_admission_never_starves_a_request(workload, limit, max_num_seqs, num_blocks):
    """Bounded waiting: no request is overtaken by later arrivals more than `max_passed_over` times, and
    every request finishes, under a stream of requests that all prefer a cached prefix."""
    sched = scheduler(
        num_blocks=num_blocks,
        prefix=True,
        prefix_aware_admission=True,
        max_passed_over=limit,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
    )
    prefixes = [list(range(10, 26)), list(range(40, 52)), list(range(70, 78)), []]
    arrivals = []
    for i, (t, family, own, max_new) in enumerate(workload):
        prompt = prefixes[family] + [100 + i] * own
        max_new = min(max_new, num_blocks * 4 - len(prompt))
        arrivals.append((t, Request(i, prompt, StoppingParams(max_new_tokens=max(1, max_new)))))
    arrivals.sort(key=lambda pair: pair[0])
    pending = list(arrivals)
    for t in range(3000):
        while pending and pending[0][0] <= t:
            sched.add(pending.pop(0)[1])
        if not pending and not sched.has_unfinished():
            break
        run_step(sched)
    requests = [r for _, r in arrivals]
    assert all(r.finish_reason == "length" for r in requests), "a request starved"
    assert max(r.passed_over for r in requests) <= limit
    assert sched.block_manager.num_free_blocks == num_blocks


def test_time_budget_is_skipped_while_the_model_warms_up():
    class Cold:
        def fit(self):
            return None

    sched = scheduler(cost_model=Cold(), tpot_target_ms=1, ttft_target_ms=1, admission="reject")
    request = make("a", 20, max_new=2)
    sched.add(request)  # no estimate yet: never rejected without evidence
    assert run_step(sched).num_tokens == [20]
