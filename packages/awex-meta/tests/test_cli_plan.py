import json
import subprocess
import sys

import pytest
from conftest import MODELS

from awex.meta.cli import main

FIELDS = {
    "total_bytes",
    "tensors",
    "ops",
    "max_rank_send_bytes",
    "max_rank_recv_bytes",
    "lower_bound_bytes",
    "redundant_bytes",
    "coverage_ok",
    "plan_seconds",
}


def run_plan(capsys, *args):
    code = main(["plan", *args, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return code, out, json.loads(out[-1])


def test_plan_cli_reports_a_summary_and_one_json_object(capsys):
    code, out, doc = run_plan(
        capsys,
        "--model",
        str(MODELS / "qwen3-8b.json"),
        "--trainer",
        "megatron:tp=2,dp=4",
        "--inference",
        "vllm:tp=2,instances=2",
        "--link-gbps",
        "2928",  # gigabits per second: 366 GB/s
    )
    assert code == 0
    assert FIELDS <= set(doc)
    assert doc["coverage_ok"] is True and doc["redundant_bytes"] == 0
    assert doc["tensors"] == 399
    # two TP=2 engines each receive the whole model once, plus a second copy of every replicated tensor (norms)
    from awex.meta import canonical_tensors, load_config

    replicated = sum(
        t.spec.nbytes for t in canonical_tensors(load_config(MODELS / "qwen3-8b.json")) if t.kind == "replicated"
    )
    assert doc["total_bytes"] == 2 * (16_381_470_720 + replicated)
    assert doc["max_rank_recv_bytes"] == doc["lower_bound_bytes"]  # a TP=2 engine rank needs half the model
    assert doc["lower_bound_seconds"] == round(doc["lower_bound_bytes"] / 366e9, 4)
    assert any("at 2928 Gb/s per rank" in line for line in out)
    assert doc["estimated_seconds"] >= doc["lower_bound_seconds"]
    assert any(line.startswith("coverage   ok") for line in out)


@pytest.mark.heavy  # minutes on 2 cores: once per CI run, not again under tox
def test_plan_cli_moe_example_from_the_readme(capsys):
    code, out, doc = run_plan(
        capsys,
        "--model",
        str(MODELS / "qwen3-235b-a22b.json"),
        "--trainer",
        "megatron:tp=4,pp=8,ep=8,dp=4,first=11,last=11",
        "--inference",
        "vllm:tp=8,ep=8,instances=16",
    )
    assert code == 0 and doc["coverage_ok"] is True
    assert doc["ranks"] == 256 and doc["tensors"] == 36_945
    assert doc["max_rank_send_bytes"] <= 1.05 * doc["lower_bound_send_bytes"]


def test_plan_cli_errors_are_clear(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    out = subprocess.run(
        [sys.executable, "-m", "awex.meta.cli", "plan", "--model", str(cfg), "--trainer", "hf", "--inference", "hf"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "no table for model architecture" in out.stderr
    assert "the engine learns its layout from its own loaders" in out.stderr  # it may still sync (OPT does)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "awex.meta.cli",
            "plan",
            "--model",
            str(MODELS / "qwen3-8b.json"),
            "--trainer",
            "megatron:tp=3",
            "--inference",
            "vllm",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "not divisible by 3" in out.stderr


def test_planning_progress_is_heard_and_changes_nothing():
    import io

    from awex.meta import canonical_tensors, load_config, plan_transfers
    from awex.meta.cli import PlanProgress
    from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout

    tensors = canonical_tensors(load_config(MODELS / "qwen3-8b.json"))
    sources = [megatron_layout(tensors, MegatronParallel(tp=2, pp=2, dp=2))]
    destinations = [vllm_layout(tensors, VllmParallel(tp=2), instance=f"vllm-{i}") for i in range(2)]
    heard = []
    plan = plan_transfers(sources, destinations, progress=lambda *a: heard.append(a))
    assert plan.digest == plan_transfers(sources, destinations).digest
    n = len(tensors)
    assert heard[0] == ("tensors", 0, n) and ("tensors", n, n) in heard
    assert [s for s, _, _ in heard[-2:]] == ["sources", "waves"]
    assert all(0 <= done <= total for _, done, total in heard)

    out = io.StringIO()
    plan_transfers(sources, destinations, progress=PlanProgress("8 layouts", quiet_seconds=0, every=0, out=out))
    lines = out.getvalue().splitlines()
    assert lines[0] == "awex-meta plan: planning 8 layouts"
    assert any(line.startswith(f"awex-meta plan: tensors {n:,}/{n:,} after") for line in lines), lines
    assert lines[-1].startswith("awex-meta plan: waves done after"), lines
    quiet = io.StringIO()  # plans that take less than a second say nothing
    plan_transfers(sources, destinations, progress=PlanProgress("x", quiet_seconds=60, out=quiet))
    assert quiet.getvalue() == ""


def test_plan_cli_plans_for_sglang_engines_with_dp_attention(capsys):
    """``sglang:...`` engine strings: expert and DP-attention layouts, every element received exactly once; an
    architecture SGLang's layout does not map is refused naming it."""
    code, out, doc = run_plan(
        capsys,
        "--model",
        str(MODELS / "qwen3-30b-a3b.json"),
        "--trainer",
        "megatron:tp=2,ep=2",
        "--inference",
        "sglang:tp=4,ep=4,attn_dp=2,dp_lm_head=1",
    )
    assert code == 0 and doc["coverage_ok"] is True and doc["redundant_bytes"] == 0
    cmd = [sys.executable, "-m", "awex.meta.cli", "plan", "--model", str(MODELS / "deepseek-v3.json")]
    cmd += ["--trainer", "megatron:tp=8,ep=8", "--inference", "sglang:tp=8"]
    refused = subprocess.run(cmd, capture_output=True, text=True)
    assert refused.returncode != 0 and "not mapped for SGLang" in refused.stderr + refused.stdout


def test_plan_cli_refuses_what_it_would_otherwise_guess(capsys):
    """A key given twice, experts split on a dense model, a rate of zero: each refused, saying why, exit status 2."""
    qwen3 = ["plan", "--model", str(MODELS / "qwen3-8b.json"), "--trainer", "megatron:tp=2"]
    for inference, extra, said in [
        ("vllm:tp=2,tp=4", [], "tp given twice"),
        ("vllm:tp=2,ep=2", [], "ep=2 splits experts, and this model has none"),
        ("vllm:tp=2", ["--link-gbps", "0"], "above zero"),
    ]:
        assert main([*qwen3, "--inference", inference, *extra]) == 2
        assert said in capsys.readouterr().err


def test_cli_help_has_no_markup_and_bad_ports_are_refused_cleanly():
    cli = [sys.executable, "-m", "awex.meta.cli"]
    for args in (["--help"], ["plan", "--help"], ["serve", "--help"]):
        out = subprocess.run([*cli, *args], capture_output=True, text=True)
        assert out.returncode == 0 and "``" not in out.stdout and ":func:" not in out.stdout
    out = subprocess.run([*cli, "serve", "--port", "99999"], capture_output=True, text=True)
    assert out.returncode == 2 and "99999 is not a port (0-65535" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--max-job-mb", "-1", "a finite size above 0"),
        ("--max-total-mb", "0", "a finite size above 0"),
        ("--max-payload-mb", "inf", "a finite size above 0"),
        ("--max-payload-mb", "nan", "a finite size above 0"),
        ("--max-job-mb", "lots", "is not a number of MB"),
        ("--max-connections", "0", "at least 16"),
        ("--max-connections", "-5", "at least 16"),
    ],
)
def test_serve_refuses_caps_that_would_refuse_everything_or_nothing(flag, value, said, capsys):
    from awex.meta.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--no-journal", flag, value])
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_plan_cli_into_a_closed_pipe_ends_quietly():
    """``awex-meta plan ... | head -1``: the reader leaves early; no traceback, exit status 0."""
    cmd = [sys.executable, "-m", "awex.meta.cli", "plan", "--model", str(MODELS / "qwen2-tiny.json")]
    cmd += ["--trainer", "hf", "--inference", "hf", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # nobody reads: the first print meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_plan_from_a_running_jobs_published_layouts_for_a_model_without_a_table(capsys):
    """``--from-job``: the layouts a job published (a trainer's, and an engine's as a vLLM receiver publishes the one
    it learned from its loaders: explicit boxes, here two ranks each holding half of each tensor's rows) are planned as
    that job would plan them, for a model Awex has no table of; bad combinations and an empty job are refused."""
    from awex.meta import Box, ExplicitSharding, Layout, Role, TensorLayout, TensorSpec
    from awex.meta.client import MetaClient
    from awex.meta.server import start_embedded

    specs = [TensorSpec(f"decoder.layers.{i}.fc1.weight", (64, 32), "bfloat16") for i in range(3)]
    specs.append(TensorSpec("decoder.embed_tokens.weight", (100, 32), "bfloat16"))
    trainer = Layout(
        "trainer",
        Role.TRAINER,
        1,
        (),
        tuple(TensorLayout(s, ExplicitSharding(((0, (Box.full(s.shape),)),))) for s in specs),
    )
    halves = [
        TensorLayout(
            s,
            ExplicitSharding(
                tuple((r, (Box((r * s.shape[0] // 2, 0), (s.shape[0] // 2, s.shape[1])),)) for r in range(2))
            ),
        )
        for s in specs
    ]
    engine = Layout("vllm-0", Role.INFERENCE, 2, (), tuple(halves))
    server = start_embedded()
    try:
        client = MetaClient(server.address, job="opt-job", timeout=10)
        code = main(["plan", "--from-job", server.address, "--job", "opt-job"])
        assert code == 2 and "published no layout" in capsys.readouterr().err
        client.publish_layout(trainer)
        code = main(["plan", "--from-job", server.address, "--job", "opt-job"])
        assert code == 2 and "published no engine layout (instances: trainer)" in capsys.readouterr().err
        client.publish_layout(engine)
        code, out, doc = run_plan(capsys, "--from-job", server.address, "--job", "opt-job")
        assert code == 0 and doc["coverage_ok"] and doc["model"] == "job opt-job", doc
        assert doc["trainer_ranks"] == 1 and doc["inference_ranks"] == 2 and doc["tensors"] == 4, doc
        assert doc["total_bytes"] == sum(s.nbytes for s in specs), doc
        assert out[1] == "trainer    trainer: 1 rank(s)" and out[2] == "inference  vllm-0: 2 rank(s)", out
        code = main(["plan", "--from-job", server.address, "--model", str(MODELS / "qwen3-8b.json")])
        assert code == 2 and "--from-job plans the job's own layouts: drop --model" in capsys.readouterr().err
        code = main(["plan", "--trainer", "hf", "--inference", "vllm"])
        assert code == 2 and "give --model (or --from-job ADDRESS" in capsys.readouterr().err
    finally:
        server.stop()
