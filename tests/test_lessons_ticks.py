"""Log-axis ticks shared by lessons 07, 10 and 11: labelled 1-2-5 steps or decades."""

from __future__ import annotations

import plotly.graph_objects as go

from minifer.lessons.ticks import log_axis, log_ticks


def test_log_ticks_cover_the_values_in_readable_steps():
    assert log_ticks([6, 40]) == [5.0, 10.0, 20.0, 50.0, 100.0]
    assert log_ticks([1, 1e6]) == [1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6]  # wide: decades only
    assert log_ticks([None, 0, -1]) == []  # nothing to show on a log axis


def test_log_axis_labels_every_tick():
    fig = go.Figure(go.Scatter(x=[1, 2000], y=[1, 2]))
    log_axis(fig, [1, 2000], "x")
    ax = fig.layout.xaxis
    assert ax.type == "log" and list(ax.tickvals) == [1, 3, 10, 30, 100, 300, 1000, 3000]
    assert list(ax.ticktext) == ["1", "3", "10", "30", "100", "300", "1,000", "3,000"]
    log_axis(fig, [100, 50_000], "y")
    assert "10k" in fig.layout.yaxis.ticktext
