"""The bench's medians over repetitions: streamed-request event counts are kept
only where a cell counted them."""

import math

from bench.stats import Cell, summarize


def _cell(rps: float, events: float = float("nan")) -> Cell:
    return Cell("x", 16, int(rps), 1.0, [0.01] * int(rps), events_per_request=events)


def test_events_per_request_is_the_median_of_the_cells_that_counted() -> None:
    summary = summarize([_cell(100, 4.0), _cell(110), _cell(120, 10.0), _cell(90, 6.0)])
    assert summary.events_per_request == 6.0
    assert summary.rps == 105.0


def test_events_per_request_is_nan_when_no_cell_counted() -> None:
    assert math.isnan(summarize([_cell(100), _cell(110)]).events_per_request)
