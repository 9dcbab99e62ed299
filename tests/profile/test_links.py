"""Link calibration: the fits (pure) and one real 2-process gloo calibration."""

from __future__ import annotations

import random

import pytest

from pipectl.artifacts.profile import LinkClass, LinkSample
from pipectl.errors import UserInputError
from pipectl.profile.links import (
    CalibrationRequest,
    LinkMeasurements,
    calibrate_links,
    fit_link_class,
    fit_nonnegative_line,
    measure_links,
    predict_allreduce_seconds,
    predict_p2p_seconds,
)

INTRA = LinkClass.INTRA_NODE


def _ring_samples(alpha: float, bandwidth: float, ring_sizes, sizes, noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    return [
        LinkSample(
            op="allreduce",
            link_class=INTRA,
            ring_size=d,
            message_bytes=n,
            seconds=2 * (d - 1) * (alpha + n / (d * bandwidth)) * (1 + noise * rng.uniform(-1, 1)),
        )
        for d in ring_sizes
        for n in sizes
    ]


def _p2p_samples(latency: float, bandwidth: float, sizes):
    return [
        LinkSample(op="p2p", link_class=INTRA, ring_size=2, message_bytes=n, seconds=latency + n / bandwidth)
        for n in sizes
    ]


SIZES = [1024 * 4**i for i in range(6)]


@pytest.mark.parametrize("alpha, bandwidth", [(2e-6, 1e10), (3e-5, 2e9), (0.0, 5e8)])
def test_fit_recovers_exact_models(alpha, bandwidth):
    samples = _ring_samples(alpha, bandwidth, [2, 3, 4], SIZES) + _p2p_samples(7e-6, 3e9, SIZES)
    fit = fit_link_class(samples, INTRA)
    assert fit.allreduce_latency_seconds == pytest.approx(alpha, abs=1e-9)
    assert fit.allreduce_bandwidth_bytes_per_second == pytest.approx(bandwidth, rel=1e-6)
    assert fit.p2p_latency_seconds == pytest.approx(7e-6, rel=1e-6)
    assert fit.p2p_bandwidth_bytes_per_second == pytest.approx(3e9, rel=1e-6)
    assert fit.p2p_jitter_seconds == pytest.approx(0.0, abs=1e-12)


def test_ring_fit_is_scale_invariant():
    # Calibrated on rings of 2 and 3 only, the fit predicts a ring of 64 (never measured).
    alpha, bandwidth = 1e-5, 4e9
    fit = fit_link_class(_ring_samples(alpha, bandwidth, [2, 3], SIZES) + _p2p_samples(1e-5, 1e9, SIZES), INTRA)
    exact = 2 * 63 * (alpha + (1 << 26) / (64 * bandwidth))
    assert predict_allreduce_seconds(fit, 1 << 26, 64) == pytest.approx(exact, rel=1e-6)
    assert predict_allreduce_seconds(fit, 1 << 26, 1) == 0.0


def test_noisy_fit_stays_close_and_non_negative():
    fit = fit_link_class(
        _ring_samples(5e-6, 2e9, [2, 3, 4], SIZES, noise=0.05, seed=3) + _p2p_samples(5e-6, 2e9, SIZES), INTRA
    )
    assert fit.allreduce_latency_seconds >= 0
    assert fit.allreduce_bandwidth_bytes_per_second == pytest.approx(2e9, rel=0.15)


def test_negative_intercept_is_clamped_to_zero():
    # Points on y = -1 + 2x: the free fit has a negative latency; the constrained fit goes through 0.
    fit = fit_nonnegative_line([1.0, 2.0, 3.0], [1.0, 3.0, 5.0])
    assert fit.intercept == 0.0
    assert fit.slope == pytest.approx(22 / 14)  # sum(xy)/sum(xx)
    assert fit.residual_std > 0


def test_jitter_comes_from_the_spread_of_small_messages():
    sizes = [1024, 4096, 65536, 1 << 20]
    measured = LinkMeasurements(
        samples=_p2p_samples(1e-5, 1e9, sizes) + _ring_samples(1e-5, 1e9, [2], sizes),
        spreads_seconds=[2e-6, 4e-6, 9e-4, 5e-3] + [1.0] * 4,  # all-reduce spreads are ignored
    )
    # The smaller half of the p2p sweep (1 KiB, 4 KiB): median of 2 and 4 µs.
    assert measured.p2p_jitter_seconds() == pytest.approx(3e-6)
    fit = fit_link_class(measured.samples, INTRA, measured.p2p_jitter_seconds())
    assert fit.p2p_jitter_seconds == pytest.approx(3e-6)


def test_fit_needs_two_message_sizes():
    with pytest.raises(UserInputError, match="2 or more message sizes"):
        fit_link_class(_ring_samples(1e-6, 1e9, [2], [4096]) + _p2p_samples(1e-6, 1e9, [4096]), INTRA)


@pytest.mark.parametrize(
    "request_, message",
    [
        (CalibrationRequest(ranks=1), "at least 2 ranks, got 1"),
        (CalibrationRequest(message_sizes=(0, 1024)), "message sizes must be positive"),
        (CalibrationRequest(backend="mpi"), "unknown backend 'mpi'"),
    ],
)
def test_bad_requests_are_user_errors(request_, message):
    with pytest.raises(UserInputError, match=message):
        measure_links(request_)


@pytest.mark.multiprocess
def test_two_gloo_processes_give_positive_bandwidth_and_non_negative_latency():
    # Bounded by the calibration itself: it terminates its children after timeout_seconds.
    request = CalibrationRequest(
        ranks=2, message_sizes=(1024, 65536, 1 << 20), warmup=1, repeats=3, timeout_seconds=45
    )
    links = calibrate_links(request)
    assert links.backend == "gloo"
    assert {(s.op, s.message_bytes) for s in links.samples} == {
        (op, n) for op in ("p2p", "allreduce") for n in (1024, 65536, 1 << 20)
    }
    assert all(s.seconds > 0 for s in links.samples)
    fit = links.fit(INTRA)
    assert fit is not None
    assert fit.p2p_bandwidth_bytes_per_second > 0 and fit.p2p_latency_seconds >= 0
    assert fit.allreduce_bandwidth_bytes_per_second > 0 and fit.allreduce_latency_seconds >= 0
    assert fit.p2p_jitter_seconds >= 0
    assert predict_p2p_seconds(fit, 1 << 20) > predict_p2p_seconds(fit, 1024)
