"""``python -m entprobe.train``: the DR-GRPO / GRPO trainer writes HF Trainer checkpoints with the online
probe's metrics in their log history, and ``entprobe.main`` probes what it wrote."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerState

from conftest import compose_cfg
from entprobe.config import ConfigError, SamplingConfig
from entprobe.integrations.grpo_trainer import TrainArgs, train
from entprobe.rollouts.logprobs import position_ids_from_mask
from entprobe.cli.probe_job import run
from entprobe.checkpoints.optim_state import load_optimizer, trainer_groups
from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch
from entprobe.tasks.arithmetic import ArithmeticTask
from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint, policy_loss
from entprobe.cli.train import main

FILES = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "optimizer.pt",
         "scheduler.pt", "trainer_state.json", "rng_state.pth"}
ARGV = ["--steps", "3", "--save-every", "2", "--probe-every", "2", "--B", "4", "--G", "4", "--probe-B-E", "4"]


@pytest.fixture(scope="module")
def run_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grpo") / "run"
    main(["--out", str(out), *ARGV])
    return out


def test_checkpoints_are_in_trainer_layout_with_the_probe_in_their_log(run_out):
    assert sorted(p.name for p in run_out.iterdir()) == ["checkpoint-2", "checkpoint-3",  # every 2 and the last
                                                          "entprobe_over_steps.csv", "entprobe_over_steps.png"]
    for step in (2, 3):
        folder = run_out / f"checkpoint-{step}"
        assert FILES <= {p.name for p in folder.iterdir()}, folder
        state = TrainerState.load_from_json(str(folder / "trainer_state.json"))  # transformers reads it
        assert state.global_step == step and state.max_steps == 3 and len(state.log_history) == step
        for entry in state.log_history:
            assert {"loss", "reward", "entropy", "learning_rate"} <= set(entry), entry
            assert all(math.isfinite(entry[k]) for k in ("loss", "reward", "entropy"))
        probed = [e["step"] for e in state.log_history if "entprobe/deltaH_pred" in e]
        assert probed == [2]  # probe-every 2: step 2 (step 1 is not a multiple of 2)
        e = state.log_history[1]
        assert e["entprobe/SE_deltaH_pred"] > 0 and math.isfinite(e["entprobe/deltaH_true"])
        # the closed-form update the probe predicted from is the step the trainer took
        assert e["entprobe/deltaH1_step"] == pytest.approx(e["entprobe/deltaH_pred"], rel=1e-3)
    sd = torch.load(run_out / "checkpoint-3" / "optimizer.pt", weights_only=True)
    assert [(len(g["params"]), g["weight_decay"], g["lr"]) for g in sd["param_groups"]] == [(16, 0.01, 1e-3),
                                                                                           (5, 0.0, 1e-3)]
    assert {int(s["step"]) for s in sd["state"].values()} == {3}
    rng = torch.load(run_out / "checkpoint-3" / "rng_state.pth", weights_only=False)
    assert {"python", "numpy", "cpu"} <= set(rng)
    model = AutoModelForCausalLM.from_pretrained(run_out / "checkpoint-3")
    AutoTokenizer.from_pretrained(run_out / "checkpoint-3")
    lo = load_optimizer(model, str(run_out / "checkpoint-3"))
    assert lo.step == 3 and lo.lr == 1e-3
    names = trainer_groups(model)[0]["names"] + trainer_groups(model)[1]["names"]
    assert lo.exp_avg_sq[0].shape == dict(model.named_parameters())[names[0]].shape


def test_main_probes_a_written_checkpoint(run_out, tmp_path):
    ckpt = run_out / "checkpoint-3"
    res = run(compose_cfg(tmp_path, "model=hf", f"model.path='{ckpt}'", f"optimizer.state_path='{ckpt}'"))
    assert res["adam_step"] == 3 and res["lr"] == 1e-3
    assert res["SE_deltaH_pred"] > 0 and math.isfinite(res["deltaH_pred"]) and math.isfinite(res["deltaH_true"])


def test_losses_are_the_trainers_formulas():
    """dr_grpo: -(1/B) sum A S / (G Lmax); grpo: -(1/(B G)) sum A (token sum / L) — TRL's grpo, written out."""
    folder = ensure_default_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    task = ArithmeticTask(64, 9, seed=0)
    batch = sample_batch(model, tok, task, draw_prompt_indices(64, 4, 1), 4, SamplingConfig(max_new_tokens=4), 1,
                         "grpo", 1e-6)
    ids, att, resp = batch.flat("cpu")
    logits = model(input_ids=ids, attention_mask=att, position_ids=position_ids_from_mask(att)).logits[:, :-1].float().log_softmax(-1)
    tok_lp = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) * resp[:, 1:]
    S, L = tok_lp.sum(-1).view(4, 4), batch.gen_lengths.float()
    A = batch.advantages
    assert policy_loss(model, batch, "grpo").item() == pytest.approx((-(A * S / L).mean()).item(), rel=1e-5)
    want = -(A * S / (4 * batch.Lmax.float().unsqueeze(-1))).sum() / 4
    assert policy_loss(model, batch, "dr_grpo").item() == pytest.approx(want.item(), rel=1e-5)


def test_bad_options_name_themselves(run_out, tmp_path):
    with pytest.raises(ConfigError, match=r"--out=.*already holds checkpoint-2: write the run to a new folder"):
        train(TrainArgs(out=str(run_out), steps=1))
    with pytest.raises(ConfigError, match=r"--resume=.*already holds checkpoint-3, which the resumed run"):
        train(TrainArgs(out=str(run_out), steps=4, resume=str(run_out / "checkpoint-2")))
    with pytest.raises(ConfigError, match=r"--steps=3: the checkpoint is at step 3"):
        train(TrainArgs(out=str(run_out), steps=3, resume="last"))
    with pytest.raises(ConfigError, match=r"--resume=last: .* holds no checkpoint"):
        train(TrainArgs(out=str(tmp_path / "x"), resume="last"))
    with pytest.raises(ConfigError, match=r"--lr-scheduler='step'"):
        train(TrainArgs(out=str(tmp_path / "x"), lr_scheduler="step"))
    with pytest.raises(ConfigError, match=r"--model='.*': not a save_pretrained folder"):
        train(TrainArgs(out=str(tmp_path / "x"), model=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"--G=1: group advantages need >= 2"):
        train(TrainArgs(out=str(tmp_path / "x"), G=1))
    # the built-in model's context is 64 tokens: a prompt plus 100 new tokens cannot fit (its positions
    # past 64 were never trained); refused naming the prompt, its length and the option to lower
    with pytest.raises(ConfigError, match=r"--task='arithmetic', prompt \d+: the prompt is \d+ tokens .* with "
                                          r"--max-new-tokens=100 needs \d+ > the model's context of 64 tokens "
                                          r"\(the model's config\).*lower --max-new-tokens"):
        train(TrainArgs(out=str(tmp_path / "x"), max_new_tokens=100))
    with pytest.raises(ConfigError, match=r"--seed=4294967296: seeds must be in \[0, 2\^32\)"):
        train(TrainArgs(out=str(tmp_path / "x"), seed=2**32))
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--loss", "ppo"])
    assert not (tmp_path / "x").exists()  # nothing written before the options are checked


def test_help_documents_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--model", "--task", "--steps", "--lr", "--lr-scheduler", "--warmup-steps", "--B", "--G",
                "--max-new-tokens", "--loss", "--save-every", "--probe-every", "--resume", "--build-default"):
        assert opt in text, opt
    main(["--build-default"])  # the default checkpoint (cached), as entprobe-build-default gives it
    assert capsys.readouterr().out.strip() == str(ensure_default_checkpoint())


def test_readme_train_command_runs_verbatim(tmp_path):
    """README "Train a probed run from zero": the trainer, then entprobe.main on its last checkpoint;
    "Probe a whole run": entprobe.probe_run over its checkpoints."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    train_cmd = "python -m entprobe.train --out runs/grpo --steps 6 --B 8 --save-every 3 --probe-every 3"
    probe_cmd = ("python -m entprobe.main model=hf model.path=runs/grpo/checkpoint-6 "
                 "optimizer.state_path=runs/grpo/checkpoint-6")
    run_cmd = "python -m entprobe.probe_run runs/grpo --out runs/grpo-over-steps"  # "Probe a whole run"
    out = []
    for cmd in (train_cmd, probe_cmd, run_cmd):
        proc = subprocess.run([sys.executable, *cmd.split()[1:]], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out.append(proc.stdout)
    probes = [x for x in out[0].splitlines() if x.startswith("[entprobe] step ") and ": predicted " in x]
    assert [x.split(":")[0] for x in probes] == ["[entprobe] step 3", "[entprobe] step 6"]  # one line per probe
    state = json.loads((tmp_path / "runs/grpo/checkpoint-6/trainer_state.json").read_text())
    assert state["global_step"] == 6 and "entprobe/deltaH_true" in state["log_history"][5]
    (run_dir,) = tmp_path.glob("outputs/*/*")
    res = json.loads((run_dir / "results.json").read_text())
    assert res["adam_step"] == 6 and res["SE_deltaH_pred"] > 0
    over = (tmp_path / "runs/grpo-over-steps/over_steps.csv").read_text().splitlines()
    assert [line.split(",")[:2] for line in over[1:]] == [["3", "ok"], ["6", "ok"]]
    assert out[2].strip().splitlines()[-1] == "entprobe: plots    runs/grpo-over-steps/over_steps.png"


def test_the_probe_leaves_the_trajectory_unchanged(run_out, tmp_path):
    """The same run without the probe writes the same weights, optimizer state and losses, bit for bit."""
    main(["--out", str(tmp_path / "plain"), *ARGV[:4], "--probe-every", "0", *ARGV[6:]])
    a, b = run_out / "checkpoint-3", tmp_path / "plain" / "checkpoint-3"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    sa, sb = (torch.load(f / "optimizer.pt", weights_only=True)["state"] for f in (a, b))
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in ("exp_avg", "exp_avg_sq"))
    la, lb = (json.loads((f / "trainer_state.json").read_text())["log_history"] for f in (a, b))
    assert [e["loss"] for e in la] == [e["loss"] for e in lb]


def test_trains_an_hf_folder_on_a_jsonl_task(run_out, tmp_path):
    """--model a save_pretrained folder (one the trainer wrote), --task a .jsonl file, --loss grpo."""
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(5) for b in range(5)))
    (ckpt,) = train(TrainArgs(out=str(tmp_path / "more"), model=str(run_out / "checkpoint-3"), task=str(data),
                              steps=1, B=4, G=4, loss="grpo"))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert ckpt.name == "checkpoint-1" and state["global_step"] == 1 and math.isfinite(state["log_history"][0]["loss"])
    before = AutoModelForCausalLM.from_pretrained(run_out / "checkpoint-3").state_dict()
    after = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the step moved the weights


def test_resumed_run_takes_the_uninterrupted_runs_steps(tmp_path):
    """A cosine schedule with warmup (transformers' own lrs, logged per step), interrupted at
    checkpoint-2 and resumed (--resume last) to step 4: the same weights, AdamW state, scheduler and
    losses, bit for bit, as the run that was never interrupted."""
    from transformers import get_scheduler

    argv = ["--steps", "4", "--save-every", "2", "--B", "4", "--G", "4", "--lr-scheduler", "cosine",
            "--warmup-steps", "2", "--lr", "1e-3"]
    main(["--out", str(tmp_path / "whole"), *argv])
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "cut" / "checkpoint-2")
    main(["--out", str(tmp_path / "cut"), *argv, "--resume", "last"])
    a, b = tmp_path / "whole" / "checkpoint-4", tmp_path / "cut" / "checkpoint-4"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    sa, sb = (torch.load(f / "optimizer.pt", weights_only=True) for f in (a, b))
    assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in ("exp_avg", "exp_avg_sq"))
    assert sa["param_groups"] == sb["param_groups"]
    assert torch.load(a / "scheduler.pt", weights_only=True) == torch.load(b / "scheduler.pt", weights_only=True)
    la, lb = (json.loads((f / "trainer_state.json").read_text())["log_history"] for f in (a, b))
    assert [e["loss"] for e in la] == [e["loss"] for e in lb] and len(lb) == 4
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=4)
    want = []
    for _ in range(4):
        want.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert [e["learning_rate"] for e in la] == want and want[0] == 0.0 and max(want) == 1e-3


def test_resume_refuses_a_checkpoint_that_is_not_one_run_step(run_out, tmp_path):
    """--resume refuses, naming the file: a trainer_state.json whose global_step is not its folder's
    (a step would be skipped), NaN in the AdamW state (every weight would turn NaN), and another
    --lr than the run's (it used to keep the old one silently)."""
    args = dict(zip(ARGV[::2], ARGV[1::2]))
    base = TrainArgs(out="", steps=int(args["--steps"]) + 1, B=int(args["--B"]), G=int(args["--G"]),
                     max_new_tokens=int(args.get("--max-new-tokens", TrainArgs(out="").max_new_tokens)),
                     save_every=int(args.get("--save-every", 1)), probe_every=0)

    def cut(name: str, damage) -> Path:
        out = tmp_path / name
        shutil.copytree(run_out / "checkpoint-3", out / "checkpoint-3")
        damage(out / "checkpoint-3")
        return out

    def step_4(folder):
        state = json.loads((folder / "trainer_state.json").read_text())
        (folder / "trainer_state.json").write_text(json.dumps({**state, "global_step": 4}))

    def nan_moment(folder):
        opt = torch.load(folder / "optimizer.pt", weights_only=True)
        next(iter(opt["state"].values()))["exp_avg_sq"].view(-1)[0] = float("nan")
        torch.save(opt, folder / "optimizer.pt")

    with pytest.raises(ValueError, match=r"trainer_state.json: global_step 4 in the folder of step 3"):
        train(TrainArgs(**{**base.__dict__, "out": str(cut("step", step_4)), "steps": 5, "resume": "last"}))
    with pytest.raises(ValueError, match=r"optimizer.pt: NaN/Inf in the AdamW state \(\['exp_avg_sq'\]\)"):
        train(TrainArgs(**{**base.__dict__, "out": str(cut("nan", nan_moment)), "resume": "last"}))
    lr = float(args.get("--lr", TrainArgs(out="").lr))
    with pytest.raises(ValueError, match=rf"scheduler.pt: the run was trained at lr {lr:g}, this command says --lr {lr * 2:g}"):
        train(TrainArgs(**{**base.__dict__, "out": str(cut("lr", lambda f: None)), "resume": "last", "lr": lr * 2}))


@pytest.mark.parametrize("defect", ["truncated_weights", "garbage_optimizer", "misshaped_weights", "empty",
                                    "broken_tokenizer", "garbage_scheduler", "foreign_scheduler",
                                    "misshaped_optimizer"])
def test_resume_names_a_damaged_checkpoint_file_before_the_model_loads(run_out, tmp_path, monkeypatch, defect):
    """--resume from a checkpoint with a truncated, garbage, mis-shaped or missing file: an error
    naming the file (never torch's, safetensors' or the tokenizer's own), before the model loads
    (the mis-shaped optimizer state, which needs the model, at the latest before a step)."""
    import entprobe.integrations.grpo_trainer as gt
    from entprobe.runtime.input_files import InputFileError

    ck = shutil.copytree(run_out / "checkpoint-3", tmp_path / "out" / "checkpoint-3")
    f = {"truncated_weights": "model.safetensors", "garbage_optimizer": "optimizer.pt", "empty": "",
         "misshaped_weights": "model.safetensors", "broken_tokenizer": "tokenizer_config.json",
         "garbage_scheduler": "scheduler.pt", "foreign_scheduler": "scheduler.pt",
         "misshaped_optimizer": "optimizer.pt"}[defect]
    if defect == "truncated_weights":
        (ck / f).write_bytes((ck / f).read_bytes()[:1000])
    elif defect in ("garbage_optimizer", "garbage_scheduler"):
        (ck / f).write_bytes(os.urandom(2000))
    elif defect == "misshaped_weights":  # a config of another width beside these weights
        cfg = json.loads((ck / "config.json").read_text())
        (ck / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] * 2}))
    elif defect == "empty":
        for p in ck.iterdir():
            p.unlink()
    elif defect == "foreign_scheduler":  # a readable file that is no scheduler's state (was KeyError: 'lr_lambdas')
        torch.save({"foo": 1}, ck / f)
    elif defect == "broken_tokenizer":
        (ck / f).write_text((ck / f).read_text()[:20])
    else:  # the first moment of another shape
        sd = torch.load(ck / f, weights_only=True)
        sd["state"][0]["exp_avg"] = torch.zeros(3)
        torch.save(sd, ck / f)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the error itself, not its one-line print
    if defect != "misshaped_optimizer":
        monkeypatch.setattr(gt, "load_policy", lambda *a: pytest.fail("the model loaded first"))
    with pytest.raises((InputFileError, ValueError)) as info:
        main(["--out", str(tmp_path / "out"), *ARGV[:1], "4", *ARGV[2:], "--resume", "last"])
    msg = str(info.value)
    assert str(ck / f) in msg and "resume from" in msg and "\n" not in msg and "weights_only" not in msg, msg


def test_resume_refuses_a_run_option_left_at_another_default_and_says_when_one_is_changed(run_out, tmp_path, capsys,
                                                                                          monkeypatch):
    """The checkpoint records the options that shape the steps: one that differs because it was left
    out (--B 4 not given again) is refused, naming it and the run's value; one given explicitly
    (--seed 7) is taken, with a printed notice."""
    out = tmp_path / "out"
    shutil.copytree(run_out / "checkpoint-3", out / "checkpoint-3")
    assert json.loads((out / "checkpoint-3" / "entprobe_train_args.json").read_text())["B"] == 4
    argv = ["--out", str(out), "--steps", "4", "--save-every", "2", "--G", "4", "--resume", "last"]
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the error itself, not its one-line print
    with pytest.raises(ConfigError, match=r"trained with --B 4 \(.*entprobe_train_args\.json\), this command leaves "
                                          r"--B at its default 16: give --B 4"):
        main(argv)
    main([*argv, "--B", "4", "--seed", "7"])
    assert "--seed 7 replaces the checkpoint's 0" in capsys.readouterr().out
    assert (out / "checkpoint-4" / "model.safetensors").is_file()


def test_cli_shows_a_progress_bar_defaults_and_one_line_errors(tmp_path, monkeypatch, capsys):
    """``python -m entprobe.train``: a tqdm bar over the steps with loss, reward and entropy (from the
    first step, continuing a resumed run's count), lines printed above it, ``--help`` with defaults,
    and a refused option as one line ``entprobe: error: ...`` with exit status 2."""
    import entprobe.cli.train as cli_train

    def fake_train(a, log, on_step):
        for step in (3, 4):  # a run resumed at step 2
            on_step({"step": step, "loss": -0.125, "reward": 0.5, "entropy": 1.25})
        log("[entprobe] step 4: saved")
        return []

    monkeypatch.setattr(cli_train, "train", fake_train)
    main(["--out", str(tmp_path / "x"), "--steps", "4"])
    out, err = capsys.readouterr()
    assert "[entprobe] step 4: saved" in out and "| 4/4 " in err and "| 2/4 " in err and "| 0/4 " not in err
    assert "loss=-0.1250" in err and "reward=0.500" in err and "entropy=1.250" in err
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "optimizer steps (default: 20)" in text and "(default: None)" not in text
    monkeypatch.undo()
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "y"), "--G", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "entprobe: error: --G=1: group advantages need >= 2 responses per prompt"
    assert "Traceback" not in err and "train:" not in err  # no bar before the options are checked
    # the guard's options in its own ranges (a floor below 0 never acts), argparse's errors on one line too
    for argv, line in ((["--guard-floor", "-1", "--probe-every", "1"],
                        "--guard-floor=-1.0: must be the lowest entropy to hold, in nats: a finite number >= 0 "
                        "(entropy is never negative, so a floor below 0 never acts) (or leave the option out)"),
                       (["--guard-max-decay", "nan", "--probe-every", "1"], "--guard-max-decay=nan: must be the"),
                       (["--guard-floor", "abc"], "argument --guard-floor: invalid float value: 'abc' "
                                                  "(python -m entprobe.train --help shows the usage)")):
        with pytest.raises(SystemExit) as info:
            main(["--out", str(tmp_path / "z"), *argv])
        err = capsys.readouterr().err.splitlines()
        assert info.value.code == 2 and len(err) == 1 and err[0].startswith(f"entprobe: error: {line}"), err
