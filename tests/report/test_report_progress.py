"""Progress line formatting and its TTY / log behaviour."""

from __future__ import annotations

import fcntl
import io
import os
import struct
import termios

import pytest

from meshlearn.report.progress import ProgressLine, format_progress
from meshlearn.report.units import format_count, format_duration


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _train(step: int, *, tokens_per_step: int = 1024, wall_per_step: float = 0.2) -> dict:
    return {
        "kind": "train",
        "step": step,
        "train_loss": 3.0 - 0.01 * step,
        "lr": 1e-3,
        "tokens": tokens_per_step * step,
        "sim_time_s": 0.025 * step,
        "wall_time_s": wall_per_step * step,
        "bytes_pp": 0,
        "bytes_dp": 0,
        "step_sim_s": 0.025,
        "step_wall_s": wall_per_step,
    }


def test_format_progress_full_line():
    line = format_progress(
        120,
        300,
        train_loss=2.0312,
        val_loss=2.1044,
        wall_tokens_per_s=5321.0,
        sim_tokens_per_s=41_200.0,
        eta_s=72.4,
    )
    assert line == (
        "step 120/300 | loss 2.031 | val 2.104 | 5.3k tok/s wall | 41.2k tok/s sim | ETA 1m12s"
    )


def test_format_progress_omits_unknown_fields():
    assert format_progress(1, 10, train_loss=9.5) == "step 1/10 | loss 9.500"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (950.4, "950"),
        (999.7, "1.0k"),
        (5321, "5.3k"),
        (41_200, "41.2k"),
        (999_960, "1.0M"),
        (2_500_000, "2.5M"),
        (3.2e9, "3.2G"),
        (float("nan"), "?"),
    ],
)
def test_format_count(value, text):
    assert format_count(value) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (42.4, "42s"),
        (72, "1m12s"),
        (605, "10m05s"),
        (7380, "2h03m"),
        (93_600, "1d02h"),
        (None, "?"),
        (-1, "?"),
        (float("inf"), "?"),
    ],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_progress_line_values_and_eta():
    out = io.StringIO()
    progress = ProgressLine(100, stream=out, every=10)
    for step in range(1, 11):
        progress.update(_train(step))
    progress.update({"kind": "eval", "step": 10, "val_loss": 2.5, "tokens": 10240})
    # 1024 tok / 0.2 s wall = 5.1k; / 0.025 s sim = 41.0k; 90 steps left * 0.2 s = 18 s.
    assert progress.line() == (
        "step 10/100 | loss 2.900 | val 2.500 | 5.1k tok/s wall | 41.0k tok/s sim | ETA 18s"
    )


def test_non_tty_prints_first_every_n_and_last():
    out = io.StringIO()
    with ProgressLine(25, stream=out, every=10) as progress:
        progress.update({"kind": "event", "what": "ignored"})
        for step in range(1, 26):
            progress.update(_train(step))
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == [
        "step 1/25",
        "step 10/25",
        "step 20/25",
        "step 25/25",
    ]
    assert "\r" not in out.getvalue()
    assert lines[-1].endswith("ETA 0s")


def test_non_tty_close_flushes_unprinted_state():
    out = io.StringIO()
    progress = ProgressLine(300, stream=out, every=10)
    for step in range(1, 14):  # crash/stop at step 13
        progress.update(_train(step))
    progress.update({"kind": "eval", "step": 13, "val_loss": 2.75})
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1/300", "step 10/300", "step 13/300"]
    assert "val 2.750" in lines[-1]


def test_tty_redraws_one_tqdm_line_in_place():
    out = FakeTTY()
    progress = ProgressLine(3, stream=out)
    for step in range(1, 4):
        progress.update(_train(step))
    progress.close()
    text = out.getvalue()
    frames = text.split("\r")[1:]  # each redraw starts with a carriage return
    assert [frame.split(" |")[0] for frame in frames] == ["step 1/3", "step 2/3", "step 3/3", "step 3/3"]
    assert text.count("\n") == 1 and text.endswith(
        "step 3/3 | loss 2.970 | 5.1k tok/s wall | 41.0k tok/s sim | ETA 0s |##########| 100%\n")


class NarrowTTY(FakeTTY):
    """A FakeTTY whose terminal (a pseudo-terminal) is 40 columns wide."""

    def __init__(self) -> None:
        super().__init__()
        self._master, self._slave = os.openpty()
        fcntl.ioctl(self._slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 40, 0, 0))

    def fileno(self) -> int:
        return self._slave

    def close(self) -> None:
        os.close(self._master)
        os.close(self._slave)
        super().close()


def test_tty_line_fits_the_terminal_and_events_go_above_it():
    out = NarrowTTY()
    with ProgressLine(5, stream=out) as progress:
        progress.update(_train(1))
        progress.update({"kind": "alert", "step": 1, "worker": "r1s2", "detail": "far"})
        progress.update(_train(2))
    text = out.getvalue()
    out.close()
    frames = [f.rstrip("\n") for f in text.split("\r")[1:]]
    assert all(len(frame.rstrip()) < 40 for frame in frames if not frame.startswith("!"))
    assert any(frame.startswith("step 2/5 |") for frame in frames)
    before, after = text.split("\r! step 1: SENTINEL alert: r1s2: far\n")  # a line of its own
    assert before.endswith("\r" + " " * 39)  # the bar cleared first
    assert after.startswith("\rstep 1/5 |") and "\rstep 2/5 |" in after  # then drawn again below it


def test_every_must_be_positive():
    with pytest.raises(ValueError, match="every"):
        ProgressLine(10, stream=io.StringIO(), every=0)


def test_format_amount_keeps_small_values_exact():
    from meshlearn.report.units import format_amount

    assert [format_amount(v) for v in (512, 2048, 3.2e6)] == ["512.0", "2,048", "3.2M"]


def test_async_staleness_per_stage_is_shown():
    line = format_progress(5, 10, train_loss=2.0, staleness=[3.0, 2.0, 1.0, 0.0])
    assert "stale 3/2/1/0" in line
    assert "stale" not in format_progress(5, 10, train_loss=2.0)


def test_in_logs_a_due_line_waits_for_its_evaluation_and_is_printed_once():
    out = io.StringIO()
    with ProgressLine(20, stream=out, every=10) as progress:
        for step in range(1, 21):
            progress.update(_train(step))
            if step % 10 == 0:
                progress.update({"kind": "eval", "step": step, "val_loss": 3.0 - step / 10})
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1/20", "step 10/20", "step 20/20"]
    assert "val 2.000" in lines[1] and "val 1.000" in lines[2]  # that step's evaluation, not the last one


def test_bans_alerts_and_rejections_get_a_console_line_of_their_own():
    out = io.StringIO()
    with ProgressLine(5, stream=out) as progress:
        progress.update(_train(1))
        progress.update({"kind": "ban", "step": 2, "worker": "r1s2", "metric": "l2", "message": "act",
                         "strikes": 2, "replaced_from": "r0s2"})
        progress.update({"kind": "wire_reject", "step": 2, "message": "act", "src": "r1s1",
                         "dst": "r1s2", "reason": "index: ids out of range"})
    text = out.getvalue()
    assert "! step 2: banned r1s2" in text and "replaced from r0s2" in text
    assert "! step 2: rejected a act from r1s1 to r1s2: index: ids out of range" in text
