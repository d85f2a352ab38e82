"""configs/accelerate, scripts/slurm_train.sh and scripts/gpu_check.sh, checked on the CPU.

Every accelerate config goes through accelerate's own loader and the argument handling of
``accelerate launch`` (deepspeed need not be installed for that), the FSDP wrap policy resolves
on each family's transformer, the SLURM script starts one correct ``accelerate launch`` per node
(with stand-ins for scontrol, srun and accelerate), and the GPU check refuses to run without a GPU
and runs its plumbing end to end with ``--cpu-smoke``.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import types
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs" / "accelerate"
FILES = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
MULTINODE = [f for f in FILES if "multinode" in f]
REQUIRED = {"ddp.yaml", "multi_gpu.yaml", "ddp_multinode.yaml", "fsdp.yaml", "fsdp_multinode.yaml",
            "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"}
# Placeholder that the multi-node files carry until --main_process_ip replaces it.
PLACEHOLDER_IP = "MAIN_NODE_IP"

# family -> (transformer class, {block class: module of diffusers that defines it}).
BLOCKS = {
    "sd3": ("SD3Transformer2DModel", {"JointTransformerBlock": "diffusers.models.attention"}),
    "flux": ("FluxTransformer2DModel", {
        "FluxTransformerBlock": "diffusers.models.transformers.transformer_flux",
        "FluxSingleTransformerBlock": "diffusers.models.transformers.transformer_flux"}),
    "wan": ("WanTransformer3DModel", {
        "WanTransformerBlock": "diffusers.models.transformers.transformer_wan"}),
}


def expected_type(name: str) -> DistributedType:
    if name.startswith("fsdp"):
        return DistributedType.FSDP
    if name.startswith("deepspeed"):
        return DistributedType.DEEPSPEED
    return DistributedType.MULTI_GPU


def single_node_counterpart(name: str) -> str:
    return name.replace("_multinode", "")


def launch(name: str, *extra: str):
    """(args, file config) as ``accelerate launch --config_file <name> ... -m flowgrpo train``
    resolves them before it starts any process. ``_validate_launch_command`` is the function the
    launcher itself calls, so what passes here is what the launcher accepts."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    argv = ["--config_file", str(CONFIG_DIR / name), "--main_process_port", str(free_port()),
            *extra, "-m", "flowgrpo", "train", "configs/toy_geneval.yaml"]
    args, defaults, mixed_precision_from_file = _validate_launch_command(
        launch_command_parser().parse_args(argv))
    if args.use_deepspeed:   # what launch_command adds before calling the DeepSpeed launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_file
                                                     else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return args, defaults


def launcher_env(name: str, *extra: str) -> dict[str, str]:
    """The accelerate/FSDP/DeepSpeed environment variables the launcher hands each process."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, _ = launch(name, *extra)
    env = prepare_deepspeed_cmd_env(args)[1] if args.use_deepspeed else prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


@functools.lru_cache(maxsize=None)
def tiny_transformer(family: str) -> torch.nn.Module:
    from pipelines.tiny import build_tiny

    return build_tiny(family).transformer


def fsdp_plugin(name: str, monkeypatch):
    """accelerate's FSDP plugin as a launched process builds it from the launcher's environment.
    Under FSDP1 sync_module_states is passed as False: with True the plugin asks the GPU for its
    device, and this machine has none (FSDP2 has no such setting)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    env = launcher_env(name)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if env.get("FSDP_VERSION", "1") == "1":
        return FullyShardedDataParallelPlugin(sync_module_states=False)
    return FullyShardedDataParallelPlugin()


# --------------------------------------------------------------------------- the config files

def test_required_files_exist():
    missing = REQUIRED - set(FILES)
    assert not missing, f"configs/accelerate lacks {sorted(missing)}"


@pytest.mark.parametrize("name", FILES)
def test_file_parses_with_accelerates_loader(name):
    config = load_config_from_file(str(CONFIG_DIR / name))
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type == expected_type(name)
    assert config.mixed_precision == "bf16"
    assert config.num_processes % config.num_machines == 0
    text = (CONFIG_DIR / name).read_text()
    assert text.startswith("#"), f"{name} must start with a comment saying what it is for"
    header = text.split("\ncompute_environment")[0]
    assert f"accelerate launch --config_file configs/accelerate/{name}" in header, \
        f"{name}'s header comment must show its launch line"


def test_multi_gpu_is_ddp():
    """configs/*.yaml and the README launch with multi_gpu.yaml: it must stay ddp.yaml."""
    ddp = ClusterConfig.from_yaml_file(str(CONFIG_DIR / "ddp.yaml")).to_dict()
    assert ClusterConfig.from_yaml_file(str(CONFIG_DIR / "multi_gpu.yaml")).to_dict() == ddp


@pytest.mark.parametrize("name", FILES)
def test_node_count(name):
    config = load_config_from_file(str(CONFIG_DIR / name))
    if name in MULTINODE:
        assert config.num_machines > 1
        assert config.main_process_ip == PLACEHOLDER_IP
        assert isinstance(config.main_process_port, int)
    else:
        assert config.num_machines == 1


@pytest.mark.parametrize("name", MULTINODE)
def test_multinode_file_is_its_single_node_file_plus_rendezvous(name):
    multi = load_config_from_file(str(CONFIG_DIR / name)).to_dict()
    single = load_config_from_file(str(CONFIG_DIR / single_node_counterpart(name))).to_dict()
    rendezvous = {"num_machines", "num_processes", "main_process_ip", "main_process_port",
                  "rdzv_backend", "same_network"}
    if "deepspeed_config" in multi:
        # srun starts one launcher per node: DeepSpeed's "standard" launcher is that
        # (torch.distributed.run per node); its default, pdsh, starts all nodes from rank 0.
        assert multi["deepspeed_config"].pop("deepspeed_multinode_launcher") == "standard"
    assert {k: v for k, v in multi.items() if k not in rendezvous} == \
        {k: v for k, v in single.items() if k not in rendezvous}
    assert multi["num_processes"] == multi["num_machines"] * single["num_processes"]


@pytest.mark.parametrize("name", [f for f in FILES if f.startswith(("fsdp", "deepspeed"))])
def test_engine_keys_are_launch_arguments(name):
    """accelerate copies fsdp_config/deepspeed_config entries onto its launch arguments without
    checking them, so a misspelt key would be silently ignored: every key must be an argument."""
    from accelerate.commands.launch import launch_command_parser

    dests = {action.dest for action in launch_command_parser()._actions}
    config = load_config_from_file(str(CONFIG_DIR / name))
    section = config.fsdp_config or config.deepspeed_config
    assert section
    for key in section:
        argument = key if key.startswith("fsdp") or not config.fsdp_config else "fsdp_" + key
        assert argument in dests, f"{name}: {key} is not an accelerate launch setting"


@pytest.mark.parametrize("name", FILES)
def test_launcher_accepts_the_file(name):
    args, _ = launch(name)
    assert args.mixed_precision == "bf16"
    assert (args.use_fsdp, args.use_deepspeed) == (name.startswith("fsdp"),
                                                   name.startswith("deepspeed"))
    assert args.multi_gpu == (expected_type(name) == DistributedType.MULTI_GPU)


@pytest.mark.parametrize("name", MULTINODE)
def test_command_line_overrides_the_node_settings(name):
    """What scripts/slurm_train.sh passes replaces the file's placeholders."""
    args, _ = launch(name, "--num_machines", "4", "--num_processes", "32", "--machine_rank", "3",
                     "--main_process_ip", "node-0")
    assert (args.num_machines, args.num_processes, args.machine_rank, args.main_process_ip) == \
        (4, 32, 3, "node-0")


@pytest.mark.parametrize("name", [f for f in FILES if f.startswith("fsdp")])
def test_fsdp_settings_reach_the_plugin(name, monkeypatch):
    from torch.distributed.fsdp import CPUOffloadPolicy, StateDictType
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = fsdp_plugin(name, monkeypatch)
    # FSDP2: the version that runs on CPU processes too (tests/test_fsdp.py) and shards frozen
    # and trainable parameters of one block without use_orig_params.
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True          # FSDP1's FULL_SHARD
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    assert not isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    # FSDP1-only settings, which accelerate would drop with a warning under FSDP2, are not set
    section = load_config_from_file(str(CONFIG_DIR / name)).fsdp_config
    fsdp1_only = {"fsdp_sharding_strategy", "fsdp_use_orig_params", "fsdp_sync_module_states",
                  "fsdp_backward_prefetch", "fsdp_forward_prefetch"}
    assert not fsdp1_only & set(section), sorted(fsdp1_only & set(section))
    assert plugin.cpu_ram_efficient_loading is False
    assert plugin.activation_checkpointing is False


@pytest.mark.parametrize("name", [f for f in FILES if f.startswith("deepspeed")])
def test_deepspeed_settings_reach_the_plugin(name, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    for key, value in launcher_env(name).items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    stage = int(name.split("zero")[1][0])
    zero = plugin.deepspeed_config["zero_optimization"]
    assert plugin.zero_stage == zero["stage"] == stage
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "none"
    assert plugin.zero3_init_flag is False
    assert plugin.deepspeed_config["gradient_clipping"] == 1.0
    assert zero["stage3_gather_16bit_weights_on_model_save"] == (stage == 3)
    # The trainer accumulates replay batches itself and refuses a DeepSpeed config that sets a
    # count of its own.
    assert str(plugin.deepspeed_config.get("gradient_accumulation_steps", "auto")) in ("auto", "1")


# --------------------------------------------------------------------------- FSDP wrapping

@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_block_classes_exist_in_diffusers(family):
    import diffusers

    model_class, blocks = BLOCKS[family]
    assert set(getattr(diffusers, model_class)._no_split_modules) == set(blocks)
    for block, module in blocks.items():
        assert isinstance(getattr(importlib.import_module(module), block), type)
    comment = (CONFIG_DIR / "fsdp.yaml").read_text().split("\ncompute_environment")[0]
    assert all(block in comment for block in blocks), "fsdp.yaml's class table is out of date"


@pytest.mark.parametrize("name", [f for f in FILES if f.startswith("fsdp")])
def test_named_wrap_classes_exist_and_belong_to_one_family(name):
    """A file may pin the wrap classes, but only importable ones of a single family: accelerate
    refuses any listed class that the wrapped model lacks."""
    listed = load_config_from_file(str(CONFIG_DIR / name)).fsdp_config.get(
        "fsdp_transformer_layer_cls_to_wrap")
    if listed is None:
        return
    names = set(listed.split(","))
    owners = [family for family, (_, blocks) in BLOCKS.items() if names <= set(blocks)]
    assert owners, f"{name}: {sorted(names)} are not the blocks of one of {sorted(BLOCKS)}"
    for block in names:
        getattr(importlib.import_module(BLOCKS[owners[0]][1][block]), block)


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_fsdp_wraps_each_block_of_every_family(family, monkeypatch):
    """The wrap policy accelerate builds for the transformer wraps exactly its block classes."""
    _, blocks = BLOCKS[family]
    plugin = fsdp_plugin("fsdp.yaml", monkeypatch)
    plugin.set_auto_wrap_policy(tiny_transformer(family))
    classes = plugin.auto_wrap_policy.keywords["transformer_layer_cls"]
    assert {c.__name__ for c in classes} == set(blocks)
    for cls in classes:
        assert cls is getattr(importlib.import_module(blocks[cls.__name__]), cls.__name__)


def test_one_class_list_for_all_families_is_refused(monkeypatch):
    """Why fsdp.yaml leaves fsdp_transformer_layer_cls_to_wrap out: one list naming every
    family's blocks fails on each model (here SD3, which has no FLUX or Wan block)."""
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP",
                       ",".join(b for _, blocks in BLOCKS.values() for b in blocks))
    plugin = fsdp_plugin("fsdp.yaml", monkeypatch)
    with pytest.raises(ValueError, match="Could not find the transformer layer class"):
        plugin.set_auto_wrap_policy(tiny_transformer("sd3"))


# --------------------------------------------------------------------------- SLURM

SLURM = ROOT / "scripts" / "slurm_train.sh"


def test_slurm_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SLURM)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shell_scripts_are_shellcheck_clean():
    result = subprocess.run(["shellcheck", str(SLURM), str(ROOT / "scripts" / "gpu_check.sh")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def fake_slurm(tmp_path: Path) -> dict[str, str]:
    """Stand-ins on PATH: scontrol lists two hosts, srun runs its command once per node with that
    node's SLURM_NODEID, accelerate writes its arguments (one a line) to a file per node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "scontrol": '[ "$1 $2" = "show hostnames" ] && printf "gpu-node-07\\ngpu-node-08\\n"\n',
        "srun": 'while [ "${1#-}" != "$1" ]; do shift; done\n'
                'for node in $(seq 0 $((SLURM_NNODES - 1))); do\n'
                '  SLURM_NODEID=$node "$@" || exit\n'
                'done\n',
        "accelerate": 'printf "%s\\n" "$@" > "$LAUNCH_LOG.$SLURM_NODEID"\n',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                SLURM_JOB_NODELIST="gpu-node-[07-08]", SLURM_NNODES="2", SLURM_JOB_ID="123456",
                SLURM_SUBMIT_DIR=str(ROOT), LAUNCH_LOG=str(tmp_path / "launch"))


def test_slurm_script_launches_one_accelerate_per_node(tmp_path):
    env = fake_slurm(tmp_path)
    overrides = ["training.lr=1e-4", "run.output_dir=/scratch/my runs"]
    result = subprocess.run(["bash", str(SLURM), "configs/sd3_pickscore.yaml", *overrides],
                            env=env, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    port = str(20000 + 123456 % 20000)
    for node in (0, 1):
        argv = (tmp_path / f"launch.{node}").read_text().splitlines()
        assert argv == ["launch", "--config_file", "configs/accelerate/ddp_multinode.yaml",
                        "--num_machines", "2", "--num_processes", "16", "--machine_rank", str(node),
                        "--main_process_ip", "gpu-node-07", "--main_process_port", port,
                        "-m", "flowgrpo", "train", "--resume", "auto", "configs/sd3_pickscore.yaml",
                        *overrides]
        # ... and accelerate resolves that line to this node's place in the job.
        args, _ = launch("ddp_multinode.yaml", *argv[3:13])
        assert (args.num_machines, args.num_processes, args.machine_rank) == (2, 16, node)
        assert args.main_process_ip == "gpu-node-07"


def test_slurm_script_refuses_bad_input(tmp_path):
    env = fake_slurm(tmp_path)
    outside = {k: v for k, v in env.items() if k != "SLURM_JOB_NODELIST"}
    result = subprocess.run(["bash", str(SLURM), "configs/sd3_pickscore.yaml"], env=outside,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "sbatch" in result.stderr
    result = subprocess.run(["bash", str(SLURM), "configs/missing.yaml"], env=env,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "configs/missing.yaml does not exist" in result.stderr
    result = subprocess.run(["bash", str(SLURM), "configs/sd3_pickscore.yaml"],
                            env=dict(env, ACCELERATE_CONFIG="configs/accelerate/nope.yaml"),
                            capture_output=True, text=True)
    assert result.returncode == 2 and "nope.yaml does not exist" in result.stderr
    assert not list(tmp_path.glob("launch.*"))


# --------------------------------------------------------------------------- GPU check

GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"


def gpu_check_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpu_check_configs_are_valid(precision, tmp_path):
    """Every run's config passes the trainer's validation here, so the GPU session does not find
    a config error (write_config calls load_config)."""
    from flowgrpo.config import load_config

    gpu_check = gpu_check_module()
    args = types.SimpleNamespace(iterations=3, cpu_smoke=False, override=[])
    for family in gpu_check.FAMILIES:
        config = load_config(gpu_check.write_config(family, precision, args, tmp_path))
        assert config.training.mixed_precision == precision
        assert config.run.max_iterations == 3
        if family != "toy":   # full fine-tuning keeps float32 master weights
            assert config.model.dtype == gpu_check.WEIGHT_DTYPES[precision]
    wide = load_config(tmp_path / "configs" / f"sd3_wide_{precision}.yaml")
    assert wide.model.options == {"height": 512, "width": 512} and wide.model.lora.rank == 32


def test_gpu_check_row_flags_an_off_policy_first_pass():
    summarise = gpu_check_module().summarise
    record = {"phase": "train", "time/iteration": 2.0, "train/first_pass_ratio_max_dev": 0.0,
              "reward/nan_count": 0}
    ok = summarise([{"phase": "eval"}, record, dict(record, **{"time/iteration": 1.0})], 1e-5)
    assert ok["status"] == "ok" and ok["seconds_per_iteration"] == 1.0
    assert ok["first_iteration_seconds"] == 2.0
    bad = summarise([dict(record, **{"train/first_pass_ratio_max_dev": 3e-4})], 1e-5)
    assert bad["status"] == "failed" and "first_pass_ratio_max_dev" in bad["error"]
    nan = summarise([dict(record, **{"train/first_pass_ratio_max_dev": float("nan")})], 1e-5)
    assert nan["status"] == "failed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_check_refuses_without_a_gpu(tmp_path):
    result = subprocess.run(["bash", str(GPU_CHECK)], env=dict(os.environ, OUT=str(tmp_path)),
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "--cpu-smoke" in result.stderr
    assert not list(tmp_path.iterdir())


def test_gpu_check_cpu_smoke_runs_end_to_end(tmp_path):
    """The whole path on the CPU (~10 s): config, child process, Trainer.train, metrics.jsonl,
    table row, JSON in $OUT."""
    result = subprocess.run(["bash", str(GPU_CHECK), "--cpu-smoke"],
                            env=dict(os.environ, OUT=str(tmp_path)), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-smoke" and report["ok"]
    [row] = report["runs"]
    assert (row["family"], row["precision"], row["status"]) == ("toy", "bf16", "ok")
    assert row["iterations"] == 1 and row["seconds_per_iteration"] > 0
    assert row["first_pass_ratio_max_dev"] == 0.0
    assert row["peak_memory_bytes"] is None   # no GPU, no GPU memory figure
    assert not report["work_dir_kept"] and not Path(report["work_dir"]).exists()
    lines = result.stdout.splitlines()
    assert any(line.startswith("family") and "peak GiB" in line for line in lines)
    assert any(line.split()[:2] == ["toy", "bf16"] and line.split()[-1] == "ok" for line in lines)


def test_wan22_fsdp_wraps_the_blocks_of_both_experts(tiny_wan22_dir, monkeypatch):
    """fsdp.yaml's transformer-based auto-wrap finds Wan's block class on the two-expert module
    (the wrap policy only; FSDP runs with the experts are untested)."""
    from pipelines import load_model
    from tests.pipeline_helpers import VIDEO_OPTIONS

    wan22 = load_model("wan", tiny_wan22_dir, options=VIDEO_OPTIONS)
    plugin = fsdp_plugin("fsdp.yaml", monkeypatch)
    plugin.set_auto_wrap_policy(wan22.transformer)
    classes = plugin.auto_wrap_policy.keywords["transformer_layer_cls"]
    assert {c.__name__ for c in classes} == {"WanTransformerBlock"}
