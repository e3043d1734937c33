"""accelerate_config.yaml (one GPU) and the configs under recipes/accelerate/ are what their names say, as accelerate's own launcher reads them
(one GPU, DDP, FSDP2 wrapping each model's blocks); the 2-process runs themselves are in test_distributed.py (CPU, gloo)."""

from pathlib import Path

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser

import hf_cgpu.models.cgpt.modeling_cgpt as modeling

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "recipes" / "accelerate"


def launch_args(name: str):
    path = ROOT / "accelerate_config.yaml" if name == "single_gpu" else CONFIGS / f"{name}.yaml"
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    return _validate_launch_command(args)[0]


@pytest.mark.parametrize("name, processes, multi_gpu, fsdp", [("single_gpu", 1, False, False),
                                                              ("ddp", 2, True, False), ("fsdp2", 2, False, True)])
def test_configs_mean_what_their_names_say(name, processes, multi_gpu, fsdp):
    args = launch_args(name)
    assert (args.num_processes, args.multi_gpu, args.use_fsdp, args.mixed_precision) == (processes, multi_gpu, fsdp,
                                                                                         "bf16")
    assert not args.use_cpu  # and no dynamo_config: --compile of the recipe decides, so CPU runs stay eager


def test_fsdp2_wraps_the_blocks_each_model_names():
    """No layer class in the config: accelerate wraps the model's ``_no_split_modules`` (GPT blocks, UNet blocks,
    GPTNeoXLayer of a fine-tuned base), so one config serves every trainer."""
    from hf_cgpu.flow.unet import FlowUNet2DModel

    args = launch_args("fsdp2")
    assert args.fsdp_version == 2 and args.fsdp_auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    assert args.fsdp_transformer_layer_cls_to_wrap is None
    for model in (modeling.CgptForCausalLM, FlowUNet2DModel):
        assert all(isinstance(getattr(__import__(model.__module__, fromlist=["x"]), name), type)
                   for name in model._no_split_modules)  # classes the model has
    assert args.fsdp_state_dict_type == "FULL_STATE_DICT"  # save_pretrained gets whole tensors
