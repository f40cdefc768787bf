"""benchmarks/real_sizes.py (edgelm against llama.cpp at real sizes) and benchmarks/shaped_checkpoints.py's shapes:
the rows, the resume keys, the report's per-round ratios, and that each shape is its model's size."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import real_sizes  # noqa: E402  (benchmarks/ is not a package)

ROOT = Path("/shaped")


def test_a_row_names_its_source_its_llamacpp_file_and_its_package():
    kept = real_sizes.Row.parse("qwen3-4b:Q4_K_M")
    assert kept.source(ROOT) == kept.gguf(ROOT) == ROOT / "qwen3-4b-Q4_K_M.gguf"
    assert kept.package(ROOT) == ROOT / "pkg-qwen3-4b-Q4_K_M"
    own = real_sizes.Row.parse("qwen3-4b:int4")  # edgelm's int4 from the folder, timed against llama.cpp's Q4_0
    assert own.source(ROOT) == ROOT / "qwen3-4b-hf"
    assert own.gguf(ROOT) == ROOT / "qwen3-4b-Q4_0.gguf"
    assert real_sizes.Row.parse("qwen3-4b:int8-weight-only").gguf(ROOT) == ROOT / "qwen3-4b-Q8_0.gguf"
    with pytest.raises(SystemExit, match="the kind must be one of"):
        real_sizes.Row.parse("qwen3-4b:Q5_K_S")
    assert len(real_sizes.parse_rows(real_sizes.ROWS)) == len(real_sizes.ROWS.split(","))


def _line(row, round_, system, decode):
    figures = {"ttft_s": 0.1, "load_s": 1.0, "peak_rss_mb": 1000.0, "load_average": 1.0, "size_mb": 400.0}
    return {"row": row, "prompt_tokens": 32, "round": round_, "system": system, "decode_tokens_per_s": decode} | figures


def test_the_report_takes_the_median_of_per_round_ratios_and_a_rerun_skips_what_is_done(tmp_path):
    results = tmp_path / "results.jsonl"
    lines = [
        _line("q:Q4_0", 0, "edgelm", 50.0), _line("q:Q4_0", 0, "llamacpp", 100.0),  # 0.50
        _line("q:Q4_0", 1, "edgelm", 90.0), _line("q:Q4_0", 1, "llamacpp", 60.0),  # 1.50
        _line("q:Q4_0", 2, "edgelm", 40.0), _line("q:Q4_0", 2, "llamacpp", 50.0),  # 0.80
        _line("q:Q4_0", 3, "edgelm", 99.0),  # a round llama.cpp did not finish: no ratio
        {"row": "q:Q8_0", "prompt_tokens": 32, "round": 0, "system": "edgelm", "error": "boom", "load_average": 1.0},
    ]  # fmt: skip
    results.write_text("\n".join(json.dumps(line) for line in lines))
    table = real_sizes.report(results)
    # the median of the ratios (0.80), not the ratio of the medians (50 / 60 = 0.83)
    assert "| q:Q4_0 | 32 | 50.0 | 60.0 | **0.80x** (0.50-1.50) |" in table
    assert "| 400 / 400 | 3 |" in table  # three rounds with both systems
    assert "FAILED q:Q8_0 32 edgelm: boom" in table
    done = real_sizes.done_keys(results)
    assert ("q:Q4_0", 32, 3, "edgelm") in done and ("q:Q4_0", 32, 3, "llamacpp") not in done
    assert ("q:Q8_0", 32, 0, "edgelm") not in done  # a failure is measured again


@pytest.mark.parametrize("name, billions", [("qwen3.5-0.8b", 0.75), ("lfm2-1.2b", 1.17), ("phi-4-mini", 3.84)])
def test_each_shape_is_its_models_size(name, billions):
    pytest.importorskip("transformers")
    import shaped_checkpoints

    _, state = shaped_checkpoints.meta_state(shaped_checkpoints.SHAPES[name])
    assert sum(t.numel() for t in state.values()) / 1e9 == pytest.approx(billions, abs=0.01)
