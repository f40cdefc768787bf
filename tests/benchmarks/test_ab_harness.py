"""benchmarks/ab.py, the one A/B harness: rounds in turn, the median of per-round ratios to a baseline, from child
commands that print a JSON line and from callables, here and spawned."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import ab  # noqa: E402  (benchmarks/ is not a package)


def _child(value: str) -> list[str]:
    """A trivial child: prints a line of noise, then its figures as a JSON line."""
    return [sys.executable, "-c", f"print('warming up'); print({value!r})"]


def test_child_commands_give_medians_and_per_round_ratios():
    variants = [
        ab.command("slow", _child('{"rate": 10, "ms": {"wall": 4}, "ids": [1, 2]}')),
        ab.command("fast", _child('{"rate": 25, "ms": {"wall": 2}, "ids": [1, 2]}')),
    ]
    result = ab.run(variants, rounds=3, baseline="slow", progress=None)
    assert result["baseline"] == "slow" and len(result["runs"]["fast"]) == 3
    assert result["runs"]["fast"][0]["ids"] == [1, 2]  # non-numbers kept in the records, out of the summary
    assert result["medians"]["fast"] == {"rate": 25.0, "ms.wall": 2.0}
    assert result["ratios"]["fast"]["rate"]["median"] == pytest.approx(2.5)
    assert result["ratios"]["fast"]["ms.wall"]["per_round"] == [0.5, 0.5, 0.5]
    assert result["ratios"]["slow"]["rate"]["median"] == 1.0
    table = ab.table(result)
    assert "| fast | rate | 25 | 2.500 | 2.500 - 2.500 |" in table
    json.dumps(result)  # the result is JSON as it is


def test_ratio_is_per_round_not_of_medians():
    """A variant whose speed drifts with the machine's: each round's ratio is 2, whatever the rounds' medians."""
    base, other = iter([10.0, 40.0, 20.0]), iter([20.0, 80.0, 40.0])
    variants = [ab.here("a", lambda: next(base)), ab.here("b", lambda: next(other))]
    result = ab.run(variants, rounds=3, progress=None)
    assert result["ratios"]["b"]["value"] == {"median": 2.0, "min": 2.0, "max": 2.0, "per_round": [2.0, 2.0, 2.0]}
    assert ab.between(result, "a", "b", "value")["median"] == 0.5


def test_orders_and_warmup():
    calls: list[str] = []
    variants = [ab.here(name, lambda name=name: calls.append(name) or 1.0) for name in "abc"]
    ab.run(variants, rounds=3, order="rotate", warmup=1, progress=None)
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    assert ab.order_of(list("abc"), 1, "reverse") == list("cba")
    with pytest.raises(ValueError, match="unknown order"):
        ab.order_of(list("ab"), 0, "random")
    with pytest.raises(ValueError, match="baseline"):
        ab.run(variants, rounds=1, baseline="z", progress=None)


def test_spawned_callable_runs_in_a_child():
    result = ab.run([ab.spawned("child", ab.figures, {"n": 3})], rounds=1, progress=None)
    assert result["medians"]["child"] == {"n": 3.0}


def test_failing_child_names_itself():
    with pytest.raises(SystemExit, match="broken failed"):
        ab.run([ab.command("broken", [sys.executable, "-c", "raise SystemExit('no model')"])], rounds=1)


def test_command_line(tmp_path):
    out = tmp_path / "ab.json"
    a = f"{sys.executable} -c 'print(3)'"
    b = f"{sys.executable} -c 'print(6)'"
    command = [sys.executable, str(BENCHMARKS / "ab.py"), "--rounds", "2", f"a={a}", f"b={b}", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "| b | value | 6 | 2.000 | 2.000 - 2.000 |" in done.stdout
    assert json.loads(out.read_text())["ratios"]["b"]["value"]["median"] == 2.0
    usage = subprocess.run([sys.executable, str(BENCHMARKS / "ab.py"), "--help"], capture_output=True, text=True)
    assert usage.returncode == 0 and "NAME=COMMAND" in usage.stdout
