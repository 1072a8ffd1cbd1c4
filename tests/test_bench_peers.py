"""`python -m minifer_course.bench peers`: the arithmetic always; the engines where the extra is installed."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import sys

import pytest
import torch

from conftest import lively_model
from minifer_course.bench import peers


def test_agreement_counts_equal_positions():
    assert peers.agreement([[1, 2, 3], [4, 5]], [[1, 2, 0], [4, 5]]) == 4 / 5
    assert peers.agreement([[1, 2]], [[1]]) == 1 / 2  # a shorter answer counts as different


def test_decode_rate_subtracts_the_prompt():
    # 4 rows, 1 then 11 new tokens: 40 decode tokens in the 2 s between the two calls
    assert peers.decode_rate(4, 11, t_one=1.0, t_all=3.0) == 20.0
    assert math.isnan(peers.decode_rate(4, 11, t_one=1.0, t_all=0.9))  # noise, not a rate
    # the 1-token times spread over more than the difference: no rate either
    assert math.isnan(peers.decode_rate(64, 32, t_one=1.86, t_all=2.06, noise=2.92 - 1.09))
    assert peers.decode_rate(4, 11, t_one=1.0, t_all=3.0, noise=0.1) == 20.0


def test_report_names_the_ratio_against_the_fastest_peer():
    row = peers.PeerRow("int8", 16, {"minifer int8 weight-only": 100.0, "minifer int8 integer":
                                     150.0, "ctranslate2 int8": 200.0},
                        {"minifer int8 weight-only": 1.1, "minifer int8 integer": 1.2,
                         "ctranslate2 int8": 1.0}, {"ctranslate2 int8": 0.5})
    assert row.ratio == 0.75
    text = peers.format_report([row])
    assert "minifer ÷ fastest peer: 0.75" in text and "ctranslate2 int8" in text
    # a NaN rate (noise hid the decode time) is no peer's speed: the ratio leaves it out
    noisy = peers.PeerRow("fp32", 1, {"minifer": 100.0, "ctranslate2 float32": math.nan,
                                      "openvino fp32": 50.0}, {}, {})
    assert noisy.ratio == 2.0


@pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None,
                    reason="needs the optional peers extra (benchmarks only, not make test)")
def test_ctranslate2_decodes_the_same_greedy_tokens_in_fp32():
    # scaled weights: clear argmax margins, so float rounding cannot flip a greedy token
    rows = peers.run(precisions=("fp32",), batches=(2,), prompt_len=8, new_tokens=8, rounds=1,
                     threads=1, model=lively_model("tiny"), peers=("ctranslate2",))
    [row] = rows
    assert row.agreement == {"minifer prepacked": 1.0, "ctranslate2 float32": 1.0}
    assert set(row.tokens_per_s) == {"minifer", "minifer prepacked", "ctranslate2 float32"}


@pytest.mark.skipif(peers.peer_problems()["openvino"] is not None,
                    reason="needs openvino-genai and optimum-intel, the optional peers extra "
                           "(benchmarks only, not make test)")
def test_openvino_decodes_the_same_greedy_tokens_in_fp32():
    # fp32 means the f32 precision hint and an f32 K/V cache: the CPU plugin's defaults (bf16
    # compute on CPUs with AVX512-BF16/AMX, an f16 cache) would round differently
    rows = peers.run(precisions=("fp32",), batches=(2,), prompt_len=8, new_tokens=8, rounds=1,
                     threads=1, model=lively_model("tiny"), peers=("openvino",))
    [row] = rows
    assert row.agreement == {"minifer prepacked": 1.0, "openvino fp32": 1.0}
    assert set(row.tokens_per_s) == {"minifer", "minifer prepacked", "openvino fp32"}


@pytest.mark.skipif(peers.peer_problems()["openvino"] is not None,
                    reason="needs the optional peers extra (benchmarks only, not make test)")
def test_openvino_left_pads_prompts_of_different_lengths():
    model = lively_model("tiny")
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    ours = peers.MiniferEngine(model).generate(prompts, 6)
    assert peers.OpenVINOEngine(model, "fp32", threads=1).generate(prompts, 6) == ours


def test_a_missing_peer_is_skipped_with_a_message(monkeypatch, capsys):
    problems = {"ctranslate2": None, "openvino": "needs openvino_genai (the optional peers extra)"}
    monkeypatch.setattr(peers, "peer_problems", lambda pythons=None: problems)
    monkeypatch.setattr(peers, "_engines", lambda model, precision, threads, folder, chosen, compiled=False, **kw:
                        [peers.MiniferEngine(model)] + [_Echo(p) for p in chosen])
    [row] = peers.run(precisions=("fp32",), batches=(1,), prompt_len=4, new_tokens=3, rounds=1,
                      model=lively_model("tiny"))
    assert set(row.tokens_per_s) == {"minifer", "ctranslate2"}
    assert "skipping openvino: it needs openvino_genai" in capsys.readouterr().err
    assert peers.available_peers() == ("ctranslate2",)


class _Echo:
    """A stand-in peer that repeats each prompt's last token."""

    def __init__(self, name: str) -> None:
        self.name = name

    def generate(self, prompts, new_tokens):
        return [[p[-1]] * new_tokens for p in prompts]


def test_without_the_extra_it_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    problem = peers.peers_problem()
    assert "pip install 'minifer[peers]'" in problem
    assert "ctranslate2 needs" in problem and "openvino needs openvino_genai" in problem
    assert peers.available_peers() == ()
    with pytest.raises(RuntimeError, match="peers extra"):
        peers.run("tiny")


def test_command_without_the_extra_says_so_and_succeeds(monkeypatch, capsys):
    from minifer_course.bench.__main__ import main

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert main(["peers", "--batches", "1"]) == 0
    assert "skipped" in capsys.readouterr().err


def test_minifer_runs_as_it_is_and_prepacked(tmp_path):
    from minifer.fast.prepack import prepack_problem

    model = lively_model("tiny")
    names = [e.name for e in peers._engines(model, "fp32", 1, tmp_path, ())]
    packed = prepack_problem() is None
    assert names == (["minifer", "minifer prepacked"] if packed else ["minifer"])
    if prepack_problem(torch.bfloat16) is None:
        names = [e.name for e in peers._engines(model, "bf16", 1, tmp_path, ())]
        assert names == ["minifer bf16"]  # prepacked by `quantize` itself


def test_compiled_adds_each_precisions_default_through_torch_compile(tmp_path):
    from minifer.quantization import integer_problem

    model = lively_model("tiny")
    fp32 = peers._engines(model, "fp32", 1, tmp_path, (), compiled=True)
    assert fp32[-1].name == "minifer compiled" and fp32[-1].compile and fp32[-1].model is model
    int8 = peers._engines(model, "int8", 1, tmp_path, (), compiled=True)
    default = "minifer int8 auto" if integer_problem() is None else "minifer int8 weight-only"
    assert [e.name for e in int8][-2:] == [default, f"{default} compiled"]
    assert int8[-1].model is int8[-2].model and not int8[-2].compile


def test_the_timed_rounds_can_run_beside_busy_cores(monkeypatch):
    loads = []

    @contextlib.contextmanager
    def fake_load(cores):
        loads.append(cores)
        yield

    import minifer_course.bench.common as common

    monkeypatch.setattr(common, "background_load", fake_load)
    monkeypatch.setattr(peers, "peer_problems", lambda pythons=None: {"ctranslate2": None, "openvino": None})
    monkeypatch.setattr(peers, "peers_problem", lambda pythons=None: None)
    monkeypatch.setattr(peers, "_engines", lambda model, precision, threads, folder, chosen, compiled=False, **kw:
                        [peers.MiniferEngine(model), _Echo("ctranslate2")])
    rows = peers.run(precisions=("fp32",), batches=(1, 2), prompt_len=4, new_tokens=3,
                     rounds=2, model=lively_model("tiny"), busy_cores=1)
    assert len(rows) == 2 and loads == [1, 1]  # one background load per batch's timed rounds
    for row in rows:  # each round's times are kept, and the spread is theirs
        for name, times in row.rounds.items():
            assert len(times) == 2 and all(0 < one and 0 < full for one, full in times)
            fulls = [full for _, full in times]
            assert row.spread[name] == max(fulls) / min(fulls)


def test_without_onednn_fp32_and_bf16_still_run_minifer_unpacked(monkeypatch, tmp_path):
    P = importlib.import_module("minifer.fast.prepack")
    monkeypatch.setattr(P, "prepack_problem", lambda dtype=None: "no oneDNN here")
    model = lively_model("tiny")
    assert [e.name for e in peers._engines(model, "fp32", 1, tmp_path, ())] == ["minifer"]
    assert [e.name for e in peers._engines(model, "bf16", 1, tmp_path, ())] == ["minifer bf16"]


def test_an_engine_in_a_process_of_its_own_decodes_the_same_tokens_and_times_itself(tmp_path):
    model = lively_model("tiny")
    prompts = [[5, 6, 7, 8], [9, 10]]
    spec = peers.EngineSpec("minifer", "minifer", "fp32")
    alone = peers.ProcessEngine(spec, model, 1, tmp_path)
    try:
        assert alone.name == "minifer"
        assert alone.generate(prompts, 5) == peers.MiniferEngine(model).generate(prompts, 5)
        assert 0 < peers.timed(alone, prompts, 5) == alone.last_seconds < 60
    finally:
        alone.close()
    assert not alone._proc.is_alive()


def test_an_engine_that_cannot_start_in_its_process_says_why(tmp_path):
    broken = peers.EngineSpec("minifer int8 turbo", "minifer", "int8", kernel="turbo")
    with pytest.raises(ValueError, match="turbo"):  # quantize's own message, from the child
        peers.ProcessEngine(broken, lively_model("tiny"), 1, tmp_path)


def test_the_specs_name_minifers_variants_then_the_peers():
    from minifer.fast.prepack import prepack_problem

    names = [s.name for s in peers.engine_specs("fp32", ("ctranslate2", "openvino"), True)]
    packed = ["minifer prepacked"] if prepack_problem() is None else []
    assert names == ["minifer", *packed, "minifer compiled", "ctranslate2 float32",
                     "openvino fp32"]
    with pytest.raises(ValueError, match="precision"):
        peers.engine_specs("fp8", ())


def test_auto_threads_adds_each_minifer_engine_with_the_governor():
    specs = peers.engine_specs("fp32", ("ctranslate2",), auto_threads=True)
    auto = [s for s in specs if s.threads == "auto"]
    assert auto and all(s.kind == "minifer" and s.name.endswith(" threads=auto") for s in auto)
    assert len(auto) == sum(s.kind == "minifer" for s in specs) // 2


def _script(path, body: str) -> str:
    """An executable shell script at `path` (a stand-in interpreter)."""
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("value, error", [
    ("openvino", "expected PEER=PATH"), ("openvino=", "expected PEER=PATH"),
    (f"onnx={sys.executable}", "unknown peer 'onnx'"),
    ("openvino=/nonexistent/bin/python", "is not an executable file"),
])
def test_peer_python_option_says_what_is_wrong(capsys, value, error):
    from minifer_course.bench.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(["peers", "--peer-python", value])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "argument --peer-python" in err and error in err


def test_peer_python_option_refuses_a_peer_twice_and_the_shared_process(tmp_path):
    from minifer_course.bench.__main__ import main

    ov = f"openvino={sys.executable}"
    with pytest.raises(SystemExit, match="--peer-python names a peer twice"):
        main(["peers", "--peer-python", ov, "--peer-python", ov])
    with pytest.raises(SystemExit, match="cannot be combined with --same-process"):
        main(["peers", "--peer-python", ov, "--same-process"])
    with pytest.raises(ValueError, match="not an executable file"):  # run's keyword, checked too
        peers.run("tiny", peer_python={"openvino": str(tmp_path)})
    with pytest.raises(ValueError, match="isolate"):
        peers.run("tiny", peer_python={"openvino": sys.executable}, isolate=False)


def test_a_peer_is_judged_by_the_interpreter_given_for_it(tmp_path):
    answer = {"path": [], "versions": {"openvino": "openvino-genai 9.9"},
              "problems": {"ctranslate2": "needs ctranslate2", "openvino": None}}
    fine = _script(tmp_path / "fine", f"echo '{json.dumps(answer)}'\n")
    here = peers.peer_problems()
    there = peers.peer_problems({"openvino": fine})
    assert there["openvino"] is None and there["ctranslate2"] == here["ctranslate2"]
    assert peers.available_peers({"openvino": fine})[-1] == "openvino"
    assert peers.peer_versions({"openvino": fine})["openvino"] == f"openvino-genai 9.9 (in {fine})"
    answer["problems"]["openvino"] = "needs openvino_genai"
    lacking = _script(tmp_path / "lacking", f"echo '{json.dumps(answer)}'\n")
    assert peers.peer_problems({"openvino": lacking})["openvino"] == (
        f"needs openvino_genai (in {lacking})")
    broken = _script(tmp_path / "broken", "echo \"No module named 'tokenizers'\" >&2; exit 1\n")
    problem = peers.peer_problems({"openvino": broken})["openvino"]
    assert "cannot import minifer" in problem and "No module named 'tokenizers'" in problem
    with pytest.raises(RuntimeError, match="cannot import minifer"):
        peers.ProcessEngine(peers.EngineSpec("minifer", "minifer", "fp32"),
                            lively_model("tiny"), 1, tmp_path, python=broken)


def test_an_engine_process_can_run_another_interpreter(tmp_path):
    from multiprocessing import spawn

    log = tmp_path / "used"
    wrapper = _script(tmp_path / "python", f'echo "$@" >> {log}\nexec {sys.executable} "$@"\n')
    model = lively_model("tiny")
    prompts = [[5, 6, 7, 8], [9, 10]]
    executable, path = spawn.get_executable(), sys.path[:]
    alone = peers.ProcessEngine(peers.EngineSpec("minifer", "minifer", "fp32"), model, 1,
                                tmp_path, python=wrapper)
    try:
        assert alone.generate(prompts, 5) == peers.MiniferEngine(model).generate(prompts, 5)
    finally:
        alone.close()
    assert "--multiprocessing-fork" in log.read_text()  # the child was started by the wrapper
    assert spawn.get_executable() == executable and sys.path == path  # both restored
