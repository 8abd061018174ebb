"""explain (one process) and doctor (every rank)."""

from __future__ import annotations

import torch

import distcompile
from tests import verify_workers, workers
from tests.harness import run_ranks
from tests.models import BUILDERS, CompilerDisable, GraphBreak, ScriptedPart, gpt


def test_explain_graph_break_without_process_group() -> None:
    exp = distcompile.explain(GraphBreak(), torch.randn(4, 64), bucket_cap_mb=0.01)
    assert len(exp.graphs) == 2 and len(exp.graph_breaks) == 1
    assert "item()" in exp.graph_breaks[0] and "models.py" in exp.graph_breaks[0]  # reason and user code line
    assert "in forward" in exp.graph_breaks[0] and "forward_" not in exp.graph_breaks[0], exp.graph_breaks[0]
    assert exp.shared == {"shared.weight": 2, "shared.bias": 2}
    assert set(exp.graphs[1].plan.foreign) == {"shared.weight", "shared.bias"}
    text = str(exp)
    assert "ends at a graph break" in text and "advice:" in text


def test_explain_eager_only_parameters_and_tied_embedding() -> None:
    exp = distcompile.explain(CompilerDisable(), torch.randn(4, 64))
    assert exp.not_in_graphs == ["eager.lin.weight", "eager.lin.bias"]
    assert any("trailing bucket" in a for a in exp.advice)
    exp = distcompile.explain(gpt(), torch.zeros(2, 16, dtype=torch.long), bucket_cap_mb=0.1)
    assert exp.shared == {"wte.weight": 2}
    assert exp.graphs[0].plan.buckets[-1].params[-1] == "wte.weight"  # first use: the last bucket


def test_explain_leaves_the_model_untouched() -> None:
    model = BUILDERS["mlp_seq"]()
    before = [p.clone() for p in model.parameters()]
    distcompile.explain(model, torch.randn(4, 64))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_doctor_all_stages_pass_on_graph_break_model() -> None:
    results = run_ranks(
        verify_workers.doctor_run, 2, "graph_break", ("eager", "aot_eager", "inductor"), timeout=600
    )
    for res in results:
        assert res["first_bad"] is None, res["text"]
        assert res["agree"] and res["status"]["inductor"] == ["ok", "ok"], res["text"]


def test_doctor_names_first_diverging_stage() -> None:
    for res in run_ranks(verify_workers.doctor_run, 2, "diverges", ("eager", "aot_eager")):
        assert res["first_bad"] == "eager", res["text"]
        # Every stage runs, whatever an earlier one did.
        assert res["status"] == {"eager": ["diverged", "diverged"], "aot_eager": ["diverged", "diverged"]}
        assert "first failing stage: eager" in res["text"]


def test_doctor_says_when_a_model_draws_from_numpys_generator() -> None:
    # Compiled, TorchDynamo draws np.random's numbers from torch's generator: a stage that
    # differs from eager DDP may differ by its draws alone, and the report says so.
    for res in run_ranks(verify_workers.doctor_run, 2, "numpy_mask", ("eager",)):
        assert "note: the model draws from NumPy's global generator" in res["text"], res["text"]
        assert "use_numpy_random_stream" in res["text"], res["text"]


def test_doctor_reports_a_crash_with_the_exception() -> None:
    for res in run_ranks(verify_workers.doctor_run, 2, "crashes", ("eager", "aot_eager")):
        assert res["first_bad"] == "eager" and res["status"]["eager"] == ["crashed", "crashed"], res["text"]
        assert res["status"]["aot_eager"] == ["crashed", "crashed"], res["text"]
        assert "rank 0 error:" in res["text"] and "Error" in res["text"], res["text"]


def test_doctor_runs_every_stage_past_a_crash_and_finds_a_corrupting_backward() -> None:
    """The torch bug of Note [Regions under checkpoint], brought back as an unknown bug would be:
    Inductor's backward overwrites a weight (torch 2.13 and 2.15), and on torch 2.13 the eager
    stage also crashes in backward. Each stage is reported for what it did, every stage runs
    past a crash, and regions=False is found to fix the failing ones."""
    for res in run_ranks(
        verify_workers.doctor_run,
        2,
        "checkpoint_around",
        ("eager", "aot_eager", "inductor"),
        "regions_under_checkpoint",
        timeout=900,
    ):
        status, text = res["status"], res["text"]
        assert status["aot_eager"] == ["ok", "ok"] and status["inductor"] == ["diverged", "diverged"], text
        assert status["inductor, regions=False"] == ["ok", "ok"], text
        assert "aot_eager, regions=False" not in status  # only failing stages are tried again
        assert "parameter blocks.0.b.weight (graph 0, segment" in res["summaries"]["inductor"][0], text
        assert "train with wrap(..., regions=False)" in text and res["agree"], text
        if status["eager"] == ["crashed", "crashed"]:  # torch 2.13
            assert "fake_mode should be enabled for HOPs" in res["summaries"]["eager"][0], text
            assert status["eager, regions=False"] == ["ok", "ok"] and res["first_bad"] == "eager", text
            assert "stages that match eager DDP: aot_eager" in text
        else:  # torch 2.15 runs the region's backward under eager
            assert status["eager"] == ["ok", "ok"] and res["first_bad"] == "inductor", text


def test_doctor_finds_parameters_that_drift_after_the_first_step() -> None:
    """A wrong gradient is in the parameters after the optimizer steps, not only in one step's gradients."""
    for res in run_ranks(verify_workers.doctor_run, 2, "grad_wrong", ("aot_eager",)):
        assert res["status"] == {"aot_eager": ["diverged", "diverged"]}, res["text"]
        assert "gradient of a.weight" in res["summaries"]["aot_eager"][0], res["text"]


def test_explain_on_one_rank_mid_training_does_not_recompile() -> None:
    assert run_ranks(workers.explain_mid_training, 2, timeout=120) == [{"graphs": 1}, {"graphs": 1}]


def test_doctor_with_keyword_inputs_and_dropout_passes_every_stage() -> None:
    for res in run_ranks(workers.doctor_keywords_dropout, 2, timeout=600):
        assert res["first_bad"] is None, res["text"]
        assert "all stages match eager DDP" in res["text"]
        assert any("fallback_random" in n for n in res["notes"]), res["text"]


def test_recompile_after_eval_keeps_every_failed_guard() -> None:
    for res in run_ranks(workers.recompile_reasons_after_eval, 2):
        reasons = res["reasons"]
        assert reasons[0] == [], "the first compile is not a recompile"
        last = reasons[-1]
        assert len(last) >= 2, last
        assert any("grad_mode" in r for r in last), last
        assert any("size mismatch" in r or "expected 8" in r for r in last), last


def test_second_model_of_one_class_is_not_a_recompile() -> None:
    for res in run_ranks(workers.two_models_one_class, 2):
        assert res["first"] == [[]] and res["second"] == [[]], res


def test_progress_lines_on_the_first_rank_warnings_prefixed() -> None:
    out0, out1 = run_ranks(workers.progress_lines, 2)
    assert "[distcompile rank 0] capturing Sequential with TorchDynamo" in out0, out0
    assert "[distcompile rank 0] graph 0:" in out0 and "compiled in" in out0, out0
    assert "[distcompile rank 0] graph 1 is a recompile" in out0, out0
    assert "size mismatch" in out0 or "expected 4" in out0, out0
    inference = next(line for line in out0.splitlines() if "graph 2:" in line)
    assert "no gradients (inference graph)" in inference and "bucket" not in inference, inference
    assert "graph 2 compiled" in out0 and "backward compiles" not in out0.split("graph 2 compiled")[1], out0
    assert "[distcompile rank 1]" not in out1, out1  # progress and the shared warning: rank 0 only


def test_parameters_trained_outside_every_graph_are_reported_once() -> None:
    rank0, rank1 = run_ranks(workers.uncompiled_report, 2)
    ((level, message),) = rank0["compiler_disable"]  # once: after the first step, not the second
    assert level == "WARNING" and message.startswith("2 of 6 trainable parameters"), message
    assert "eager.lin.weight" in message and "47% of the bytes" in message, message
    assert "TORCH_LOGS=graph_breaks" in message, message
    assert rank0["mlp_seq"] == [] and rank1["mlp_seq"] == rank1["compiler_disable"] == [], (rank0, rank1)
    # A frame TorchDynamo skipped (a TorchScript submodule called in it): its reason, said at once.
    for res in (rank0, rank1):
        (level, message), *rest = res["scripted_part"]
        assert level == "INFO" and "did not trace the forward" in message, message
        assert "torch.jit.script" in message and "Developer debug context" not in message, message
    assert [m[:9] for _, m in rank0["scripted_part"][1:]] == ["8 of 8 tr"], rank0["scripted_part"]


def test_explain_names_the_reason_for_a_frame_torchdynamo_skipped() -> None:
    model = ScriptedPart()
    model.after_copy()
    exp = distcompile.explain(model, torch.randn(4, 64))
    assert exp.graphs == [] and len(exp.not_in_graphs) == 8, exp
    (reason,) = exp.untraced
    assert reason.startswith("torch.jit.script/freeze modules unsupported"), reason
    text = str(exp)
    assert "code TorchDynamo did not trace" in text and "scripted from" in text, text


def test_a_guard_that_fails_at_every_call_is_said_once_per_recompile() -> None:
    res0, res1 = run_ranks(workers.counter_recompiles, 2)
    assert [len(r) for r in res0["reasons"]] == [0, 1, 2, 3]  # the API keeps every failed guard
    out0 = res0["out"]
    assert "graph 3 is a recompile (3 failed guard(s), in TorchDynamo's order):" in out0, out0
    listed = [line for line in out0.splitlines() if line.startswith("  0/")]
    assert len(listed) == 3, out0  # one line per recompile, not 1 + 2 + 3
    assert (
        "calls == 2" in listed[-1] and "[the same guard failed on 2 older versions: 0/1, 0/0]" in listed[-1]
    )
    assert "with eager (recompile: 0/2: self.calls == 2, 3 failed guard(s))" in out0, out0
    assert res1["out"] == "", res1["out"]
