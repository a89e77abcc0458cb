"""A LoRA checkpoint written by TRL + peft (GRPOTrainer with a peft_config on the built-in model:
tests/trl_lora_checkpoint.py) probed end to end through ``entprobe.main.run``, and the bad inputs
a PEFT checkpoint brings: an optimizer state that is not the adapter's, a base folder that is gone,
a base recorded as a hub id. (The exact-enumeration checks of deltaH1 and of the ground truth on a
LoRA adapter are the ``lora`` variants in test_stage1_exact.py, test_ground_truth.py and test_ground_truth_restore.py.)"""
from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import entprobe.cli.probe_job as main_mod
from conftest import compose_cfg, fp_tol
from entprobe.config import ConfigError, ModelConfig, ModelSource
from entprobe.runtime.input_files import InputFileError
from entprobe.checkpoints.models import load_model
from entprobe.checkpoints.optim_state import OptimizerStateError
from entprobe.checkpoints.peft import AdapterError, adapter_module
from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint
from trl_lora_checkpoint import LR, RANK, STEPS, TARGETS

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def trl_ckpt(tmp_path_factory) -> tuple[Path, list[list[str]]]:
    """(checkpoint-3 folder, the Trainer's optimizer groups by parameter name) from a real TRL run."""
    out = tmp_path_factory.mktemp("trl_lora")
    base = ensure_default_checkpoint()
    proc = subprocess.run([sys.executable, str(HERE / "trl_lora_checkpoint.py"), str(base), str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = Path(proc.stdout.strip().splitlines()[-1])
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "scheduler.pt",
            "trainer_state.json"} <= {p.name for p in folder.iterdir()}
    return folder, json.loads((out / "param_order.json").read_text())


def peft_name(saved_key: str) -> str:
    """adapter_model.safetensors key -> the loaded PeftModel's parameter name (adapter 'default')."""
    stem, _, leaf = saved_key.rpartition(".")
    return f"{stem}.default.{leaf}"


def adam_P(st: dict, beta2: float, eps: float) -> torch.Tensor:
    return 1.0 / ((st["exp_avg_sq"].double() / (1 - beta2 ** int(st["step"]))).sqrt() + eps)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_trl_lora_checkpoint_is_probed_end_to_end(trl_ckpt, tmp_path, monkeypatch):
    folder, order = trl_ckpt
    seen = {}
    for name in ("load_probe", "build_geometry"):  # keep the loaded model and optimizer to inspect after
        real = getattr(main_mod, name)
        monkeypatch.setattr(main_mod, name, lambda *a, _real=real, _n=name, **k: seen.setdefault(_n, _real(*a, **k)))
    res = main_mod.run(compose_cfg(tmp_path, "model=hf", f"model.path='{folder}'", "probe.save_buffers=true"))

    for k in ("deltaH1", "deltaH_pred", "deltaH_true"):
        assert math.isfinite(res[k]) and math.isfinite(res[f"SE_{k}"]) and res[f"SE_{k}"] > 0, k
    assert res["model_source"].startswith(f"peft:{folder}") and res["adapter_type"] == "LORA"
    assert (res["adapter_r"], res["adapter_base_path"]) == (RANK, str(ensure_default_checkpoint()))
    assert (res["lr"], res["lr_source"], res["adam_step"]) == (LR, "scheduler.pt", STEPS)
    assert res["optimizer_path"] == str(folder / "optimizer.pt")  # found beside the adapter

    # the trainable parameters are exactly the adapter's, and P is each one's own Adam state: the
    # Trainer's group order as TRL's live optimizer recorded it, not as entprobe rebuilds it
    adapter = {peft_name(k): v for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}
    lm, _, ctx = seen["load_probe"]
    assert len(ctx.names) == len(adapter) and set(ctx.names) == set(adapter)
    assert res["adapter_trainable_params"] == sum(v.numel() for v in adapter.values())
    sd = torch.load(folder / "optimizer.pt", weights_only=True)
    assert [len(g["params"]) for g in sd["param_groups"]] == [len(g) for g in order] == [len(adapter), 0]
    position = {n: i for i, n in enumerate(order[0] + order[1])}
    buffers = load_file(str(tmp_path / "buffers.safetensors"))
    assert {k[2:] for k in buffers if k.startswith("P/")} == set(adapter)
    for n in adapter:
        want = adam_P(sd["state"][position[n]], res["adam_beta2"], res["adam_eps"]).float()
        # fp32 P: four roundings (the bias correction, the root, + eps, the reciprocal) against fp64
        assert ((buffers[f"P/{n}"].double() - want.double()).abs()
                <= fp_tol(torch.float32, 1.0, 4, worst_case=True) * want.double().abs()).all(), n

    # attribution by adapted module: lora_A and lora_B of each target summed
    with (tmp_path / "attribution.csv").open() as f:
        rows = list(csv.DictReader(f))
    modules = {r["module"] for r in rows}
    assert modules == {adapter_module(n) for n in adapter}
    assert {m.rsplit(".", 1)[1] for m in modules} == set(TARGETS) and len(modules) == 2 * len(TARGETS)
    for m in modules:
        terms = [float(r["bars_dot_term"]) for r in rows if r["module"] == m]
        # the module's term is the sum of its two parameters' fp64 terms: one fp64 rounding of their magnitudes
        assert len(terms) == 2 and all(abs(float(r["module_bars_dot_term"]) - sum(terms)) <= fp_tol(
            torch.float64, sum(abs(t) for t in terms), 2, worst_case=True) for r in rows if r["module"] == m)
    top = res["attr/module_top01/name"]
    assert top in modules and abs(res["attr/module_top01/bars_dot_term"]) == max(
        abs(float(r["module_bars_dot_term"])) for r in rows)

    # after the real step and the restore: the adapter, the frozen base and the Adam state are the files' bits
    named = dict(lm.model.named_parameters())
    assert all(bits_equal(named[n].detach(), adapter[n]) for n in adapter)
    base = load_file(str(ensure_default_checkpoint() / "model.safetensors"))
    frozen = {n: p for n, p in named.items() if not p.requires_grad}
    assert len(frozen) == len(base) and all(p.grad is None for p in named.values())
    for n, p in frozen.items():
        key = n.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert bits_equal(p.detach(), base[key]), n
    live = seen["build_geometry"][0].optimizer.state
    for n in adapter:
        st, saved = live[named[n]], sd["state"][position[n]]
        assert bits_equal(st["exp_avg"], saved["exp_avg"]) and bits_equal(st["exp_avg_sq"], saved["exp_avg_sq"]), n
        assert float(st["step"]) == float(saved["step"]) == STEPS


# ---------------------------------------------------------------- bad inputs
def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "ckpt"))


def _run(tmp_path, folder, *extra):
    return main_mod.run(compose_cfg(tmp_path / "run", "model=hf", f"model.path='{folder}'", *extra))


def test_an_optimizer_state_that_is_not_the_adapters_names_the_parameter(trl_ckpt, tmp_path):
    folder, order = trl_ckpt
    ckpt = _copy(folder, tmp_path)
    # the full model's optimizer.pt (the base's own training): 16 + 5 parameters, not the adapter's 12
    shutil.copy(ensure_default_checkpoint() / "optimizer.pt", ckpt / "optimizer.pt")
    first = order[0][0]
    with pytest.raises(OptimizerStateError, match=rf"param group 0: the checkpoint has 16 parameters, the model's "
                       rf"decay group has 12; first bad parameter '{first}' \(position 0\): checkpoint \(18, 64\)"):
        _run(tmp_path, ckpt)
    # an adapter of rank 8 on the same targets: the counts agree, a shape does not
    sd = torch.load(folder / "optimizer.pt", weights_only=True)
    i = next(i for i, n in enumerate(order[0]) if "v_proj.lora_B" in n)
    sd["state"][i] = {k: (torch.cat([v, v], 1) if k.startswith("exp_avg") else v) for k, v in sd["state"][i].items()}
    torch.save(sd, ckpt / "optimizer.pt")
    with pytest.raises(OptimizerStateError, match=rf"state shape mismatch at parameter '{order[0][i]}': "
                       r"checkpoint \(32, 8\) vs model \(32, 4\)"):
        _run(tmp_path, ckpt)


def _with_base(folder: Path, tmp_path: Path, recorded: str) -> Path:
    ckpt = _copy(folder, tmp_path)
    acfg = json.loads((ckpt / "adapter_config.json").read_text())
    acfg["base_model_name_or_path"] = recorded
    (ckpt / "adapter_config.json").write_text(json.dumps(acfg))
    return ckpt


def test_a_base_folder_that_is_gone_says_to_set_model_base_path(trl_ckpt, tmp_path):
    ckpt = _with_base(trl_ckpt[0], tmp_path, str(tmp_path / "moved-away"))
    with pytest.raises(AdapterError, match=r"base model folder '.*moved-away' .* does not exist here: set model\.base_path="):
        _run(tmp_path, ckpt)
    with pytest.raises(AdapterError, match=r"model\.base_path='/nonexistent/base' is not a folder"):
        _run(tmp_path, ckpt, "model.base_path=/nonexistent/base")
    with pytest.raises(AdapterError, match=r"has no config\.json"):
        _run(tmp_path, ckpt, f"model.base_path='{tmp_path}'")


def test_a_hub_id_base_is_refused_and_model_base_path_replaces_it(trl_ckpt, tmp_path):
    ckpt = _with_base(trl_ckpt[0], tmp_path, "HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(AdapterError, match=r"'HuggingFaceTB/SmolLM2-135M' .* is no folder here but a Hugging Face Hub "
                       r"id, and entprobe downloads nothing.*set model\.base_path="):
        _run(tmp_path, ckpt)
    base = ensure_default_checkpoint()
    lm = load_model(ModelConfig(source=ModelSource.hf, path=str(ckpt), base_path=str(base), device="cpu"))
    trainable = [n for n, p in lm.model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * len(TARGETS) and all(adapter_module(n) for n in trainable)
    assert lm.meta["adapter_base_path"] == str(base) and lm.checkpoint_dir == str(ckpt)


def test_a_truncated_adapter_is_named_before_anything_loads(trl_ckpt, tmp_path):
    ckpt = _copy(trl_ckpt[0], tmp_path)
    weights = ckpt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(InputFileError, match=r"adapter_model\.safetensors.*copy the adapter checkpoint again"):
        _run(tmp_path, ckpt)


def test_base_path_without_an_adapter_is_refused(tmp_path):
    base = ensure_default_checkpoint()
    with pytest.raises(AdapterError, match=r"model\.base_path is set but model\.path=.* holds no adapter_config\.json"):
        _run(tmp_path, base, f"model.base_path='{base}'")
    with pytest.raises(ConfigError, match=r"model\.base_path: is the base model of a PEFT adapter.*model=hf"):
        main_mod.run(compose_cfg(tmp_path / "tiny", f"model.base_path='{base}'"))


def test_adapter_parameters_are_named_by_their_module_for_every_recognised_kind():
    """peft's own names for LoRA with DoRA, an embedding LoRA, IA3 and a fully trained copy
    (modules_to_save): every trainable parameter maps to the module it adapts."""
    from peft import IA3Config, LoraConfig, get_peft_model

    from entprobe.checkpoints.builtin import build_tiny_llama

    configs = {
        "dora+copy": (LoraConfig(r=2, target_modules=["q_proj"], use_dora=True, modules_to_save=["lm_head"]),
                      {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "lm_head"}),
        "embedding": (LoraConfig(r=2, target_modules=["embed_tokens"]), {"model.embed_tokens"}),
        "ia3": (IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
                {f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.k_proj", "mlp.down_proj")}),
    }
    for label, (config, modules) in configs.items():
        model = get_peft_model(build_tiny_llama(18, hidden=16, heads=2), config)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert {adapter_module(n) for n in names} == modules, label
        assert all(adapter_module(n) is None for n, p in model.named_parameters() if not p.requires_grad), label


def test_weights_holding_code_are_refused_in_our_words_when_loaded_without_preflight(tmp_path):
    """load_model (the Python API, no preflight) on a pytorch_model.bin holding code: the file named,
    torch's advice to retry with weights_only=False never relayed, nothing executed."""
    ck = shutil.copytree(ensure_default_checkpoint(), tmp_path / "ck")
    (ck / "model.safetensors").unlink()
    torch.save({"hook": os.getcwd}, ck / "pytorch_model.bin")
    with pytest.raises(InputFileError) as info:
        load_model(ModelConfig(source=ModelSource.hf, path=str(ck), device="cpu"))
    msg = str(info.value)
    assert msg.startswith(f"{ck}: the model files hold pickled Python code") and "weights_only" not in msg, msg


def test_an_adapter_whose_rank_is_not_its_configs_is_refused_by_load_model(tmp_path):
    """load_model (no preflight) checks the adapter's files too: LoRA matrices of rank 2 under a
    config that says r=4 are named (peft's load raised torch's size-mismatch dump)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = ensure_default_checkpoint()
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj"])
                   ).save_pretrained(tmp_path / "lora")
    cfg = tmp_path / "lora" / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "r": 4}))
    with pytest.raises(AdapterError, match=rf"{tmp_path / 'lora' / 'adapter_model.safetensors'}: .*lora_A.* has "
                                           rf"rank 2 .*{cfg} says r=4"):
        load_model(ModelConfig(source=ModelSource.hf, path=str(tmp_path / "lora"), base_path=str(base), device="cpu"))
