"""Files a flag names are written before anything is printed, into parent folders made as
needed: a reader that stops early (``| head``) costs no file, and a --png / --plot / --trace
into a folder that does not exist yet writes there as --out does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from apps.cli import main


def _with_reader_gone(*args: str) -> int:
    # stdout is a pipe whose reader is gone before the command prints anything: every write
    # to it fails with EPIPE, as `meshplan ... | head -c 0` would
    proc = subprocess.Popen([sys.executable, "-m", "apps.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    proc.stdout.close()
    return proc.wait(timeout=300)


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_plan_csv_is_written_though_the_reader_is_gone(tmp_path, json_flag):
    folder = tmp_path / "new [1]" / "csv out"
    assert _with_reader_gone("plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu",
                             "--ranks", "2", "--csv", str(folder), *json_flag) == 0
    assert (folder / "ranked.csv").read_text().startswith("id,")
    assert (folder / "rejected.csv").is_file()


def test_topo_png_goes_into_a_new_folder(tmp_path, capsys):
    path = tmp_path / "pics [a]" / "t p.png"
    assert main(["topo", "dgx-h100", "--png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"     # the PNG signature


def test_validate_plot_goes_into_a_new_folder(tmp_path, capsys):
    runs = tmp_path / "runs.csv"
    runs.write_text(RUN_ROW)
    plot, csv = tmp_path / "pl [1]" / "p.png", tmp_path / "out.csv"
    assert main(["validate", "--runs", str(runs), "--plot", str(plot), "--csv", str(csv)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and csv.is_file()


def test_validate_a_header_without_rows_is_bad_input(tmp_path, capsys):
    runs = tmp_path / "v_header.csv"
    runs.write_text(RUN_ROW.splitlines()[0] + "\n")
    assert main(["validate", "--runs", str(runs)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "v_header.csv has a header but no rows; add one row per run under the header" in err


# row r000 of ../shared/data/published_runs.csv (Megatron-LM weak scaling, GPT 1.7B on 32
# A100s), its notes left out
RUN_ROW = ("id,source,table,model,params_b,layers,hidden,heads,kv_heads,ffn_hidden,vocab,"
           "seq_len,gpu,num_gpus,tp,pp,dp,cp,vpp,micro_batch,global_batch,recompute,"
           "sequence_parallel,zero_stage,ref_step_time_s,ref_step_time_kind,"
           "reported_tflops_per_gpu,reported_mfu,reported_hfu,notes\n"
           "r000,Narayanan et al. 2021 (SC21) 'Efficient Large-Scale Language Model Training "
           "on GPU Clusters Using Megatron-LM' arXiv:2104.04473,Table 1 (weak scaling),"
           "GPT 1.7B,1.7,24,2304,24,,9216,51200,2048,A100-SXM4-80GB (Selene DGX A100),32,1,1,"
           "32,,,,512,full,no,,3.5,derived,137,,44%,\n")


@pytest.mark.parametrize("tp, fits", [(1, False), (8, True)])
def test_simulate_json_says_whether_the_plan_fits(tmp_path, capsys, tp, fits):
    # llama3-8b unsharded (tp=1, dp=8, no ZeRO): mixed-precision Adam's 16 bytes a parameter
    # (ZeRO, Rajbhandari et al. 2020, §3.1) are ~128 GB per GPU, over the 80 GB of an H100;
    # over tp=8 they are ~16 GB and it fits
    import json

    from apps.clusters import cluster_from_flags, cluster_ref
    from planner.planfile import PlanFile, write_plan_file
    from planner.presets import load_model
    from planner.spec import Plan
    model, cluster = load_model("llama3-8b"), cluster_from_flags("dgx-h100", 1, None, None)
    plan = Plan(tp=tp, pp=1, dp=8 // tp, micro_batch=1, global_batch=8, recompute="full")
    path = write_plan_file(tmp_path / "p.yaml", PlanFile(
        model=model, plan=plan, prediction={}, cluster=cluster_ref(cluster, plan, "dgx-h100")))
    assert main(["simulate", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is fits
    assert (out["out_of_memory"] is None) is fits
