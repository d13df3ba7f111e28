"""The one rule by which predicted and measured bytes over time are averaged and peaked."""

from hetero.schema.series import Sweep, levels, sweep


def test_sweep_averages_a_step_function_over_the_window():
    # 10 before the window, 30 from t=2 to 3, 0 from t=3: average over [1, 5] = (10*1 + 30*1) / 4
    assert sweep([(0.0, 10), (2.0, 30), (3.0, 0), (9.0, 50)], 1.0, 5.0) == Sweep(10, 30)


def test_levels_free_before_they_allocate_at_one_moment():
    # a layer's 8 bytes leave at t=2 as the next one's 8 arrive: 8 in use then, never 16
    curve = levels([(1.0, 8), (2.0, 8), (2.0, -8), (3.0, -8)])
    assert curve == [(1.0, 8), (2.0, 0), (2.0, 8), (3.0, 0)]
    assert sweep(curve, 0.0, 4.0) == Sweep(avg_bytes=4, peak_bytes=8)


def test_an_empty_window_is_its_value_at_the_start():
    assert sweep([(0.0, 7)], 1.0, 1.0) == Sweep(7, 7)
    assert sweep([], 0.0, 1.0) == Sweep(0, 0)
