"""The DS4 and V4.1 models are created on the device their config names (``verl_ds4.models.ds4.device``).

Built on the ``meta`` device with CPU initialisation off (``use_cpu_initialization=False``,
``init_model_with_meta_device=True``: Megatron's own fields), every parameter and buffer of the whole
models lands there: DS4 with its MTP block and a value head, V4.1's Megatron model (Engram, CSA2, the
critic head), V4.1's pure-PyTorch backbone and the DSpark drafter. Before the device rule the mHC
modules, the final norms and MTP's ``e_proj`` / ``h_proj`` / ``enorm`` stayed on the CPU.
Negative control: one CPU buffer slipped into a meta model is found by the same check. The CPU
default is unchanged (every tensor on the CPU, ``use_cpu_initialization=True``).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def megatron_single_rank():
    """Megatron's parallel state on one gloo rank (TP = PP = CP = 1), as the models are built under it."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from verl_ds4.mcore.distributed import free_port

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()


def off_device(model: torch.nn.Module, device: str) -> list[str]:
    """Names of the parameters and buffers of ``model`` that are not on ``device``'s type."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    assert tensors
    return [f"{name} on {t.device}" for name, t in tensors if t.device.type != device]


def _ds4(device, value_head=False):
    from verl_ds4.models.ds4.model import build_ds4_model
    from verl_ds4.verify.parity import INDEXER_LOSS_COEFF, _ds4_config

    cfg = _ds4_config(None)  # the tiny DS4 that verify builds: one MTP depth
    return build_ds4_model(cfg, dtype=torch.float32, cp_size=1, device=device, value_head=value_head,
                           allow_mtp_skip=value_head, config_overrides={"dsa_indexer_loss_coeff": INDEXER_LOSS_COEFF})


def test_ds4_is_built_on_the_meta_device():
    model = _ds4("meta")
    assert model.config.use_cpu_initialization is False and model.config.init_model_with_meta_device is True
    assert model.mtp_block is not None
    names = [n for n, _ in model.named_parameters()]
    for part in ("attn_hc", "hc_head", "final_layernorm", "mtp.layers.0.e_proj", "mtp.layers.0.enorm", "embedding", "output_layer"):
        assert any(part in n for n in names), part
    assert off_device(model, "meta") == []
    critic = _ds4("meta", value_head=True)
    assert off_device(critic, "meta") == []
    assert critic.output_layer.weight.device.type == "meta"


def test_a_cpu_tensor_in_a_meta_model_is_found():
    model = _ds4("meta")
    model.decoder.register_buffer("stray", torch.zeros(3))  # negative control: one tensor left on the CPU
    assert off_device(model, "meta") == ["decoder.stray on cpu"]


def test_a_cpu_config_built_inside_a_meta_context_stays_on_meta():
    """PyTorch's ``with torch.device("meta")`` wins over a config's CPU initialisation (the full-size
    count test builds Flash and Pro this way: on the CPU they would need ~570 GB / ~3 TB)."""
    with torch.device("meta"):
        model = _ds4(None)
    assert model.config.use_cpu_initialization is True and off_device(model, "meta") == []


def test_an_override_contradicting_the_device_is_refused():
    from verl_ds4.models.ds4.model import build_ds4_model
    from verl_ds4.verify.parity import _ds4_config

    with pytest.raises(ValueError, match=r"config_overrides\['use_cpu_initialization'\]=True contradicts device='meta'"):
        build_ds4_model(_ds4_config(None), dtype=torch.float32, device="meta", config_overrides={"use_cpu_initialization": True})
    # control: the same override without a device is the caller's choice, and agreeing values pass
    assert build_ds4_model(_ds4_config(None), dtype=torch.float32, config_overrides={"use_cpu_initialization": True})
    assert build_ds4_model(_ds4_config(None), dtype=torch.float32, device="meta",
                           config_overrides={"init_model_with_meta_device": True}).config.init_model_with_meta_device


def test_ds4_default_stays_on_the_cpu():
    model = _ds4(None)
    assert model.config.use_cpu_initialization is True
    assert off_device(model, "cpu") == []
    assert model.output_layer.weight.abs().sum() > 0  # the seeded weights were written


def _ds41_text():
    from verl_ds4.models.ds41 import reference as ref
    from verl_ds4.models.ds41.engram import engram_token_map

    return ref.tiny_text_config(), engram_token_map(ref.local_tokenizer())[0]


def test_ds41_megatron_model_is_built_on_the_meta_device():
    from verl_ds4.models.ds41.mcore_model import DS41MegatronModel, ds41_transformer_config

    text, table = _ds41_text()
    config = ds41_transformer_config(text, torch.float32, 1, use_cpu_initialization=False, init_model_with_meta_device=True)
    for value_head in (False, True):
        model = DS41MegatronModel(config, table, value_head=value_head)
        assert model.decoder.engram_hasher is not None
        assert off_device(model, "meta") == []
    assert config.use_cpu_initialization is False  # restored after Megatron's layers were built


def test_ds41_backbone_and_drafter_are_built_on_the_meta_device():
    from verl_ds4.models.ds41.dspark import DS41DSpark
    from verl_ds4.models.ds41.model import DS41Model

    text, table = _ds41_text()
    assert off_device(DS41Model(text, table, dtype=torch.float32, device="meta"), "meta") == []
    drafter = DS41DSpark(text, dtype=torch.float32, device="meta")
    assert off_device(drafter, "meta") == []
    assert off_device(DS41DSpark(text, dtype=torch.float32), "cpu") == []  # the default: the CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ds4_is_built_on_cuda():
    model = _ds4("cuda")
    assert off_device(model, "cuda") == []
