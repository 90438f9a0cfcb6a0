"""bench/fault_injection.py's reading of a run (the benchmark itself injects faults into real runs; the cheap
cases are tests/test_elastic.py, test_resilience.py and test_data.py): the losses an interrupted run ends with,
the time it took to resume, from the flow's own lines."""

from __future__ import annotations

from pathlib import Path

from bench import fault_injection

LINE = (" iteration {i:>8}/      24 | consumed samples:          {s} | elapsed time per iteration (ms): 120.0 | "
        "learning rate: 3.000000E-03 | global batch size:     4 | lm loss: {loss:.6E} | loss scale: 1.0 |\n")


class _Logged:
    """A launch's lines with their times, as bench/fault_injection.Launch keeps them."""

    def __init__(self, lines: list[tuple[float, str]]):
        self.lines = lines

    iterations = fault_injection.Launch.iterations


def test_the_losses_are_each_iterations_last_and_recovery_runs_to_the_resumed_first_iteration():
    first = _Logged([(1.0, LINE.format(i=1, s=4, loss=6.25)), (2.0, LINE.format(i=2, s=8, loss=6.0)),
                     (3.0, LINE.format(i=3, s=12, loss=5.5)), (9.0, "loaded /c/iter_0000002 (iteration 2)\n"),
                     (10.0, LINE.format(i=3, s=12, loss=5.75))])
    second = _Logged([(20.0, "loaded /c/iter_0000003 (iteration 3)\n"), (21.5, LINE.format(i=4, s=16, loss=5.0))])
    assert fault_injection._losses([first, second]) == {1: 6.25, 2: 6.0, 3: 5.75, 4: 5.0}
    assert fault_injection._recovery([first, second], [3.5]) == 6.5
    assert fault_injection._recovery([first, second], [3.5, 15.0]) == 6.5
    assert fault_injection._recovery([first], [11.0]) is None  # never resumed


def test_a_refused_run_shows_its_one_error_line(tmp_path: Path):
    logged = _Logged([(1.0, "error: checking --data-path failed on rank 0: DataError: x.bin is 2 bytes short\n"),
                      (1.1, "error: checking --data-path failed on rank 0: DataError: x.bin is 2 bytes short\n")])
    assert fault_injection._error_lines([logged]) == [
        "error: checking --data-path failed on rank 0: DataError: x.bin is 2 bytes short"]
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "iter_0000008.partial").mkdir()
    assert fault_injection._checkpoints(tmp_path) == {4}
