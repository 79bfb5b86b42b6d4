"""`pagedlab bench`: every workload runs on a tiny model at tiny sizes and its table has every column.

Nothing here is timed: the numbers are checked for shape and for the few facts that hold at any speed.
"""

from __future__ import annotations

import json
import types

import pytest

from pagedlab.bench import COMPARATORS, WORKLOADS, BenchOptions, run_benchmark, run_metrics, suites, systems, workloads
from pagedlab.bench.report import Table
from tests.helpers import tiny_model

TINY = dict(
    num_requests=3, prompt_len=(5, 30), output_mean=6, output_len=(2, 12), batch_sizes=(2,), max_num_seqs=8,
    max_num_batched_tokens=256, prefix_len=48, prefix_max_tokens=3, sharing_prompt_len=20, sharing_max_tokens=4,
    sharing_n=3, beam_width=2, request_rates=(100.0,), overhead_sizes=(8, 16), overhead_real_sizes=(8,), scale=0.03,
    decode_probe_mib=16,
)


def _run(workload: str, **options):
    return run_benchmark(workload, model=tiny_model(), progress=False, **{**TINY, **options})


def _check_tables(report, keys):
    assert list(report.tables) == keys
    for key in keys:
        table = report.tables[key]
        assert table.columns == suites.COLUMNS[key]
        assert table.rows, f"{key}: no rows"
        for row in table.rows:
            assert tuple(row) == table.columns
        text = table.text()
        assert all(column in text for column in table.columns)


def test_every_workload_has_a_runner_and_columns():
    assert set(suites.RUNNERS) == set(WORKLOADS)
    assert set(WORKLOADS) <= set(suites.COLUMNS)


def test_chat_with_every_comparator_and_sweep(tmp_path):
    report = _run("chat", compare=tuple(c for c in COMPARATORS if c != "vllm"), sweep_max_num_seqs=(2, 8))
    _check_tables(report, ["chat", "sweep"])
    systems = [row["system"] for row in report.tables["chat"].rows]
    assert systems == ["pagedlab", "hf-static(bs=2)", "hf-cb", "pagedlab-contiguous"]
    by_system = {r.system: r for r in report.results}
    reference = by_system["pagedlab"].token_ids
    assert by_system["pagedlab-contiguous"].token_ids == reference  # same runner, same greedy tokens
    assert [len(t) for t in by_system["hf-cb"].token_ids] == [len(t) for t in reference]
    rows = {row["system"]: row for row in report.tables["chat"].rows}
    assert rows["pagedlab-contiguous"]["same_tokens"] == 1.0 and rows["pagedlab"]["vs_pagedlab"] == "1.00x"
    for row in report.tables["chat"].rows:
        assert row["output_tok_s"] > 0 and row["linear_flops_frac"] > 0 and row["peak_kv_mb"] > 0
        assert 0 <= row["same_tokens"] <= 1 and row["vs_pagedlab"].replace("tie (", "").rstrip(")").endswith("x")
    paths = report.save(tmp_path)
    assert {p.name for p in paths} >= {"chat.json", "chat.txt", "chat_throughput.png", "chat_kv_utilization.png",
                                       "chat_sweep_max_num_seqs.png"}
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert saved["machine"]["threads"] >= 1 and saved["tables"]["chat"]["columns"] == list(suites.COLUMNS["chat"])


def test_nano_vllm():
    report = _run("nano-vllm", compare=("pagedlab-contiguous",), num_requests=None)
    _check_tables(report, ["nano-vllm"])
    assert report.tables["nano-vllm"].rows[0]["requests"] == round(256 * TINY["scale"])


def test_prefix_caching_cuts_prefill_and_keeps_outputs():
    report = _run("prefix", num_requests=4, max_num_batched_tokens=64)  # one prompt per step: later ones hit
    _check_tables(report, ["prefix"])
    off, on = report.tables["prefix"].rows
    assert not off["prefix_caching"] and on["prefix_caching"]
    assert on["prefill_tokens"] < off["prefill_tokens"] and on["outputs_identical"]


def test_sharing_uses_fewer_blocks_than_copies():
    report = _run("sharing")
    _check_tables(report, ["sharing"])
    for row in report.tables["sharing"].rows:
        assert row["peak_blocks_shared"] < row["peak_blocks_unshared"]


def test_pressure_preempts_and_keeps_outputs():
    report = _run("pressure", num_requests=4)
    _check_tables(report, ["pressure"])
    ample, *squeezed = report.tables["pressure"].rows
    assert ample["preemptions"] == 0
    assert all(row["outputs_identical"] for row in squeezed)


def test_serving_in_process_and_over_http_against_its_own_server():
    report = _run("serving", request_rates=(100.0, 1000.0))
    _check_tables(report, ["serving"])
    rows = report.tables["serving"].rows
    assert [row["system"] for row in rows] == ["pagedlab (in-process)", "pagedlab serve (HTTP)"] * 2
    for row in rows:
        assert row["failed"] == 0 and 0 < row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"]
    assert len({r.num_output_tokens for r in report.results}) == 1  # every request got all its tokens
    assert "serving_latency.png" in report.plots


def test_serving_against_an_endpoint_measures_it_over_http_only():
    from pagedlab.engine import LLMEngine
    from pagedlab.entrypoints.openai.api_server import ServerThread, build_app

    engine = LLMEngine(tiny_model(), None, systems.engine_config(max_num_seqs=8))
    with ServerThread(build_app(engine, "tiny")) as server:
        report = _run("serving", endpoint=server.url)
    (row,) = report.tables["serving"].rows
    assert row["system"] == server.url and row["failed"] == 0 and row["output_tok_s"] > 0


def test_overhead():
    report = _run("overhead")
    _check_tables(report, ["overhead"])
    first, second = report.tables["overhead"].rows
    assert first["scheduler_ms_per_step"] > 0 and first["share_of_step"] is not None
    assert second["real_step_ms"] is None


def test_capacity():
    report = _run("capacity", num_requests=40, capacity_reservations=(2, 4))
    _check_tables(report, ["capacity"])
    for row in report.tables["capacity"].rows:
        assert row["contiguous_peak"] == row["kv_slots"] // (30 + 12)  # one max_model_len reservation each
        assert row["paged_peak"] > row["contiguous_peak"] and row["ratio_mean"] > 1


def test_decode_reports_attention_against_the_memory():
    report = _run("decode", decode_dtypes=("float32", "bfloat16"), decode_batch_sizes=(2,), decode_contexts=(8, 40),
                  repeats=2)
    _check_tables(report, ["decode"])
    rows = report.tables["decode"].rows
    assert [(r["dtype"], r["context"]) for r in rows] == [("float32", 8), ("float32", 40), ("bfloat16", 8),
                                                         ("bfloat16", 40)]
    config = tiny_model().config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4  # float32 bytes per token, K and V, every layer
    assert rows[1]["kv_read_mb"] == pytest.approx(2 * 40 * per_token / 1e6)
    for row in rows:
        assert row["step_ms"] > 0 and row["no_attention_ms"] > 0 and row["read_gb_s"] > 0


def test_decode_step_kernel_and_torch_path_agree():
    """The decode workload's step gives the same logits with the C++ kernel and with the torch path."""
    import contextlib

    import torch

    from pagedlab.bench.decode import DecodeStep, attention_implementation, cpu_kernel_off
    from pagedlab.worker.attention import ATTENTION_NAME, PagedAttentionContext

    model = tiny_model()
    step = DecodeStep.build(model, batch=3, context=37, block_size=4)
    logits = []
    with torch.inference_mode():
        for switch in (contextlib.nullcontext(), cpu_kernel_off()):
            context = PagedAttentionContext(step.metadata, step.kv_cache.clone(), "torch")
            with switch, attention_implementation(model, ATTENTION_NAME):
                logits.append(model(input_ids=step.input_ids[None], position_ids=step.positions[None],
                                    use_cache=False, pagedlab_context=context).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="workload"):
        run_benchmark("nope", model=tiny_model(), progress=False)
    with pytest.raises(ValueError, match="comparator"):
        run_benchmark("chat", model=tiny_model(), progress=False, compare=("sglang",))


def test_workloads_are_seeded_and_sized():
    a = workloads.chat(None, 128, num_requests=16, seed=3)
    assert a == workloads.chat(None, 128, num_requests=16, seed=3)
    assert all(20 <= r.num_prompt_tokens <= 400 and 16 <= r.max_tokens <= 512 for r in a.requests)
    n = workloads.nano_vllm(1000, scale=0.1)
    assert len(n.requests) == 26 and all(10 <= r.num_prompt_tokens <= 102 for r in n.requests)


def test_metrics():
    assert run_metrics.percentile([1, 2, 3, 4], 50) == 2.5
    assert run_metrics.Summary.of([1.0, 3.0]).mean == 2.0
    samples = run_metrics.static_batch_kv([2, 4], [1, 3])  # width 4: rows hold 2+min(t,1) and 4+min(t,3) of 2x(4+t)
    assert [(s.allocated, s.live) for s in samples] == [(10, 8), (12, 9), (14, 10)]
    table = Table("t", ("a", "b"))
    with pytest.raises(ValueError, match="missing"):
        table.add(a=1)


def test_cli_bench_writes_json_and_table(tmp_path, capsys):
    from pagedlab.cli import main

    tiny_model().save_pretrained(tmp_path / "model")  # a folder without a tokenizer: token-id prompts
    out = tmp_path / "out"
    argv = ["bench", "--workload", "overhead", "--model", str(tmp_path / "model"), "--overhead-sizes", "8",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "scheduler_ms_per_step" in capsys.readouterr().out
    assert json.loads((out / "overhead.json").read_text())["tables"]["overhead"]["rows"][0]["num_seqs"] == 8


def test_calibrate_fits_and_measures_its_error(tmp_path):
    """The calibration's plumbing on a tiny model (whose step times mean nothing): tables, and calibration.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedlab.sim import load_calibration
    from tests.helpers import TINY_CONFIG

    model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "max_position_embeddings": 2048})).eval()
    report = run_benchmark("calibrate", model=model, progress=False, out_dir=tmp_path, **{**TINY, "scale": 0.1})
    _check_tables(report, ["calibrate", "calibrate_error", "calibrate_serving"])
    errors = {row["workload"]: row for row in report.tables["calibrate_error"].rows}
    assert {name for name, row in errors.items() if row["fitted"]} == {"decode", "prefill", "long-context"}
    assert {"chat", "pressure-swap", "pressure-recompute"} <= set(errors)
    calibration = load_calibration(tmp_path / "calibration.json")
    assert calibration.error["steps"]["chat"]["num_steps"] == errors["chat"]["steps"]
    assert calibration.preemption.copy_bytes_per_s > 0 and calibration.kv_bytes_per_token > 0


def test_the_cpu_is_named_with_its_vector_instructions():
    """Figures are recorded with the CPU, and machines of one model name differ in their widest vector unit."""
    import torch

    from pagedlab.bench.report import cpu_model

    name = cpu_model()
    assert name.endswith(f" with {torch.backends.cpu.get_cpu_capability()}") and len(name) > len(" with AVX2")


@pytest.mark.parametrize("cpu_fused_ops", [True, False])
def test_the_bench_starts_its_own_server_with_the_benchs_engine_options(cpu_fused_ops):
    """Without --endpoint the serving bench starts `pagedlab serve` with its engine options as flags: serve must
    take every one and mean the same by it (it refused --cpu-fused-ops, so the serving bench of a model by name
    or the embedded one failed to start its server)."""
    from pagedlab import cli
    from pagedlab.bench import http_client

    bench = types.SimpleNamespace(options=BenchOptions(cpu_fused_ops=cpu_fused_ops))
    workload = workloads.Workload("w", (workloads.RequestSpec((1, 2, 3), 4),), "fixed")
    options = suites._engine_options(bench, workload)
    command = http_client.serve_command(tiny_model("llama"), None, options)
    args = cli._parser().parse_args(command[3:])  # after `python -m pagedlab`; a flag it does not know exits
    assert systems.engine_config(**cli._engine_kwargs(args)) == systems.engine_config(**options)


def test_token_latencies_cover_every_step_of_a_run_longer_than_the_engines_trace():
    """The engine keeps only its last `max_trace_steps` records (1,000 by default): the bench must still see
    every token's time, not zip the kept records with the first step times (which gave negative TTFTs)."""
    workload = workloads.random_prompts(128, num_requests=3, prompt_len=6, max_tokens=12)
    arrivals = [0.0, 0.0, 0.05]
    result = systems.run_pagedlab(tiny_model(), None, workload, arrivals=arrivals, max_trace_steps=4,
                                  max_num_seqs=8, max_num_batched_tokens=256)
    assert len(result.extra["ttft_s"]) == 3 and min(result.extra["ttft_s"]) >= 0
    assert len(result.extra["tpot_s"]) == 3
    assert len(result.extra["itl_s"]) == 3 * (12 - 1)
    assert result.peak_num_seqs >= 2 and result.steady_batch >= 1


@pytest.mark.parametrize("given, via", [("both", ("in-process", "http")), ("http", ("http",)),
                                        ("in-process,http", ("in-process", "http"))])
def test_serving_via_takes_the_values_its_help_names(given, via):
    from pagedlab import cli

    assert cli._parser().parse_args(["bench", "--workload", "serving", "--serving-via", given]).serving_via == via
