"""minifer_course.lessons.kernels: the twin that measures overhead (OPT-1) and attention's bytes (OPT-2)."""

import pytest

from minifer.config import GPTConfig
from minifer_course.lessons import kernels as KN


def test_twin_keeps_the_graph_and_drops_the_arithmetic():
    ref = GPTConfig.preset("reference")
    t = KN.twin(ref)
    assert (t.n_layer, t.n_head, t.vocab_size) == (ref.n_layer, ref.n_head, ref.vocab_size)
    assert t.n_embd == 2 * ref.n_head and t.head_dim == 2


def test_step_ms_and_overhead_rows_on_a_tiny_model():
    tiny = GPTConfig.preset("tiny")
    rows = KN.overhead_rows({"tiny": tiny}, context=8, steps=3)
    assert len(rows) == 1 and rows[0]["step ms"] > 0 and rows[0]["twin step ms"] > 0
    assert 0 < rows[0]["outside arithmetic"] <= 1
    with pytest.raises(ValueError, match="context and steps"):
        KN.step_ms(None, context=0)


def test_compile_sentence_reads_the_numbers():
    r = {"reason": "", "eager": 1.0, "compiled": 0.5, "eager twin": 0.9, "compiled twin": 0.3,
         "eager share": 0.9, "compiled share": 0.6}
    text = KN.compile_sentence(r)
    assert "2.00× faster" in text and "from 90% to 60%" in text
    assert "no faster" in KN.compile_sentence(dict(r, compiled=2.0))
    assert "could not run" in KN.compile_sentence({"reason": "no compiler"})


def test_attention_bytes_counts_the_score_matrix_four_times():
    b = KN.attention_bytes(256, 64, block=128, causal=False)
    assert b["score matrix"] == 256 * 256 * 4
    assert b["plain"] == (4 * 256 * 64 + 4 * 256 * 256) * 4
    assert b["tiled"] == (2 * 256 * 64 + 2 * 2 * 256 * 64) * 4  # K and V read once per query block
    causal = KN.attention_bytes(256, 64, block=128)  # the first block reads only K/V up to itself
    assert causal["tiled"] == (2 * 256 * 64 + 2 * (128 + 256) * 64) * 4
    assert KN.attention_bytes(4096, 64)["plain"] > 7 * KN.attention_bytes(4096, 64)["tiled"]
    with pytest.raises(ValueError, match="block"):
        KN.attention_bytes(16, 64, block=0)
