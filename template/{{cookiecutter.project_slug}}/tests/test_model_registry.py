"""Model variants side by side: `model.kind` picks a registered module; the dense transformer is
the default, and a name no module registers is refused with the known ones."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from trainer.config import ConfigError, build_config, preset_raw
from trainer.model import registry
from trainer.model.transformer import TransformerLM
from trainer.model.transformer import param_count as dense_count
from trainer.train_step import build_program


def tiny(*overrides: str):
    return build_config(preset_raw("tiny"), overrides)


class _ScaledEmbedding(TransformerLM):
    """A toy variant: the dense model with one extra learned scalar on the embedding."""

    def __init__(self, cfg, *, rngs):
        super().__init__(cfg, rngs=rngs)
        self.embed_scale = nnx.Param(np.ones((), np.float32))

    def hidden(self, tokens_BxL):
        return super().hidden(tokens_BxL) * self.embed_scale[...]


@pytest.fixture
def toy_kind():
    registry.register("scaled-embedding",
                      param_count=lambda cfg: dense_count(cfg) + 1)(_ScaledEmbedding)
    yield "scaled-embedding"
    registry._KINDS.pop("scaled-embedding")


def test_the_dense_transformer_is_the_default_kind():
    config = tiny()
    assert config.model.kind == "transformer" and "transformer" in registry.known_kinds()
    assert registry.param_count(config.model) == dense_count(config.model) == 115_008
    model = registry.build_model(config.model, rngs=nnx.Rngs(params=0))
    assert type(model) is TransformerLM


def test_a_registered_variant_is_built_counted_and_trained_by_name(toy_kind):
    config = tiny(f"model.kind={toy_kind}")
    assert registry.param_count(config.model) == 115_009
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1),
                ("pipeline", "data", "fsdp", "tensor"))
    program = build_program(config, mesh)
    state = program.init()
    assert float(state["params"]["embed_scale"]) == 1.0
    batch = jax.numpy.zeros(program.batch_shape, jax.numpy.int32)
    for _ in range(2):  # the first step's learning rate is 0 (warm-up)
        state, metrics = program.step(state, batch)
    assert bool(metrics["finite"]) and float(state["params"]["embed_scale"]) != 1.0


def test_an_unknown_kind_is_refused_with_the_known_ones(toy_kind):
    config = tiny("model.kind=no-such-kind")
    with pytest.raises(ConfigError, match=r"model\.kind = 'no-such-kind': no such model variant; "
                                          r"known: (.+, )?scaled-embedding, (.+, )?transformer "
                                          r"\(a module in trainer/model/ registers one with "
                                          r"@register\)"):
        registry.build_model(config.model, rngs=nnx.Rngs(params=0))
    with pytest.raises(ConfigError, match="model.kind = 'no-such-kind'"):
        registry.param_count(config.model)


def test_two_variants_of_one_name_are_refused(toy_kind):
    with pytest.raises(ValueError, match="model kind 'scaled-embedding' is registered twice"):
        registry.register(toy_kind)(TransformerLM)


def test_a_variants_settings_come_from_its_preset_table_or_set_and_are_checked_by_it():
    import toy_local_global

    kind = f"model.kind={toy_local_global.KIND}"
    raw = preset_raw("tiny")
    raw["model"] = {**raw["model"], "settings": {"window": 4}}
    from_table = build_config(raw, [kind])
    assert registry.settings(from_table.model) == {"logit_cap": 30.0, "window": 4,
                                                   "z_loss": 1e-4}
    overridden = build_config(raw, [kind, "model.settings.window=2", "model.settings.z_loss=0"])
    assert registry.settings(overridden.model) == {"logit_cap": 30.0, "window": 2,
                                                   "z_loss": 0.0}  # an int where a float is
    for overrides, message in (
            (["model.settings.windw=3"], r"^model.settings.windw \(did you mean "
                                         r"model.settings.window\?\): model.kind = "
                                         r"'toy-local-global' has no such setting; its settings: "
                                         r"logit_cap, window, z_loss$"),
            (["model.settings.window=2.5"], r"^model.settings.window = 2.5: expected int \(the "
                                            r"default of model.kind = 'toy-local-global' is 8\)$"),
            (["model.settings.window=true"], r"expected int")):
        with pytest.raises(ConfigError, match=message):
            registry.describe(tiny(kind, *overrides).model)
    with pytest.raises(ConfigError, match=r"model.settings.window: model.kind = 'transformer' "
                                          r"has no such setting; its settings: none"):
        registry.describe(tiny("model.settings.window=3").model)
    raw["model"]["settings"] = {"window": [1, 2]}
    with pytest.raises(ConfigError, match=r"model.settings.window = \[1, 2\]: only scalar"):
        build_config(raw, [kind])
