"""Healthy third-party models at random init, small enough for CI, each with its own ``example_inputs``
so that ``hookcli check healthy_zoo:NAME`` needs no flag (issue #23: no false positives).

torchvision and timm at 32x32 to 64x64 (the smallest sizes at which no stage shrinks to 1x1 in a batch
of 2, where train-mode BatchNorm has two values per channel), transformers from tiny configs (2 layers,
hidden size 32). ``NAMES`` lists them; tests/test_check_probes.py checks every one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

#: The batch of every example: 2 (train-mode BatchNorm needs two values per channel; grad_accumulation
#: splits it into two halves of 1).
BATCH = 2


def _images(model: nn.Module, size: int) -> nn.Module:
    model.example_inputs = (torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(0)),)
    return model


class Tokens(nn.Module):
    """A transformers model called with token ids (decoder tokens too for an encoder-decoder)."""

    def __init__(self, model: nn.Module, decoder: bool = False, vocab: int = 100) -> None:
        super().__init__()
        self.m, self.decoder = model, decoder
        self.example_inputs = (torch.randint(1, vocab, (BATCH, 16), generator=torch.Generator().manual_seed(0)),)

    def forward(self, input_ids: torch.Tensor):  # noqa: ANN201 - the model's own output type
        if self.decoder:
            return self.m(input_ids=input_ids, decoder_input_ids=input_ids)
        return self.m(input_ids=input_ids)


def _tv(name: str, size: int, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return _images(getattr(torchvision.models, name)(weights=None, **kwargs), size)
    return build


def _timm(name: str, size: int, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return _images(timm.create_model(name, pretrained=False, **kwargs), size)
    return build


def _hf(config: str, model: str, decoder: bool = False, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config)(**kwargs)
        return Tokens(getattr(transformers, model)(cfg), decoder=decoder)
    return build


MODELS: dict[str, Callable[[], nn.Module]] = {
    # torchvision
    "resnet18": _tv("resnet18", 64),
    "mobilenet_v3_small": _tv("mobilenet_v3_small", 64),
    "squeezenet1_1": _tv("squeezenet1_1", 64),
    "mnasnet0_5": _tv("mnasnet0_5", 64),
    # timm: layer scale (edgenext, cait, convnext), zero-initialised last BatchNorm (resnet10t)
    "edgenext_xx_small": _timm("edgenext_xx_small", 64),
    "cait_xxs24_224": _timm("cait_xxs24_224", 32, img_size=32, depth=2),
    "convnext_atto": _timm("convnext_atto", 32),
    "resnet10t": _timm("resnet10t", 32, zero_init_last=True),
    "deit_tiny_patch16_224": _timm("deit_tiny_patch16_224", 32, img_size=32, depth=2),
    "ghostnet_050": _timm("ghostnet_050", 64),
    # transformers (tiny configs)
    "gpt2": _hf("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                bos_token_id=0, eos_token_id=0),
    "bert": _hf("BertConfig", "BertForMaskedLM", num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                intermediate_size=64, vocab_size=100),
    "t5": _hf("T5Config", "T5ForConditionalGeneration", decoder=True, num_layers=2, d_model=32, d_ff=64, num_heads=2,
              d_kv=16, vocab_size=100),
    "llama": _hf("LlamaConfig", "LlamaForCausalLM", num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                 num_key_value_heads=2, intermediate_size=64, vocab_size=100, max_position_embeddings=64),
    "distilbert": _hf("DistilBertConfig", "DistilBertForMaskedLM", n_layers=2, dim=32, n_heads=2, hidden_dim=64,
                      vocab_size=100),
    "opt": _hf("OPTConfig", "OPTForCausalLM", num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
               ffn_dim=64, vocab_size=100, max_position_embeddings=64, word_embed_proj_dim=32),
}
NAMES = list(MODELS)

globals().update(MODELS)  # healthy_zoo:NAME is a factory hookcli can build
