"""Location health from a sliding error rate, and the latency budget (pure, no I/O)."""

from kvmesh.services.kvstore.health import HealthPolicy, LocationHealth

P = HealthPolicy(window_s=10.0, min_errors=3, error_rate=0.6, retry_s=2.0, factor=2.0,
                 floor_s=0.1, ceiling_s=5.0, samples=64)


def test_one_timeout_among_good_reads_never_takes_a_location_down():
    h = LocationHealth(P)
    for t in range(20):
        h.record(float(t) / 10, True, 0.02)
    h.record(2.0, False)  # a 5 s timeout
    assert not h.down(2.0)
    assert h.error_rate(2.0) == (1, 1 / 21)


def test_down_after_enough_errors_at_a_high_rate_and_back_on_success():
    h = LocationHealth(P)
    h.record(0.0, True, 0.02)
    h.record(0.1, False)
    h.record(0.2, False)
    assert not h.down(0.2)  # 2 errors: below min_errors
    h.record(0.3, False)
    assert h.down(0.3)  # 3 of 4 = 75 % >= 60 %
    assert h.claim_trial(0.3) and not h.claim_trial(1.0) and h.claim_trial(2.4)
    h.record(2.5, True, 0.02)  # the trial answered
    assert not h.down(2.5) and h.error_rate(2.5) == (0, 0.0)


def test_errors_age_out_of_the_window():
    h = LocationHealth(P)
    for t in (0.0, 0.1, 0.2):
        h.record(t, False)
    assert h.down(0.3)
    assert h.down(10.0) and not h.down(10.05)  # the first error left the window: 2 remain


def test_refused_connection_is_down_at_once_until_a_success():
    h = LocationHealth(P)
    for t in range(10):
        h.record(float(t) / 10, True, 0.02)
    h.record(1.0, False, refused=True)
    assert h.down(1.0)
    h.record(1.5, False)  # a later timeout keeps it down only by rate (1 of 12: no)
    assert not h.down(1.5)
    h.record(1.6, False, refused=True)
    h.record(3.7, True, 0.02)
    assert not h.down(3.7)


def test_budget_is_factor_times_p90_within_floor_and_ceiling():
    h = LocationHealth(P)
    assert h.budget() == 0.1  # no samples: the floor
    for i in range(10):  # latencies 0.01 .. 0.10: p90 = 0.10 (index 9 of 10)
        h.record(float(i), True, 0.01 * (i + 1))
    assert abs(h.budget() - 0.2) < 1e-9
    for i in range(64):
        h.record(20.0 + i, True, 9.0)
    assert h.budget() == 5.0
