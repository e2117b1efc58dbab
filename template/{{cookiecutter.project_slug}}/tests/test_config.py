import dataclasses
import tomllib

import pytest

from trainer.config import (
    BUILTIN_MESH_AXES,
    CONFIG_DIR,
    SECTIONS,
    ConfigError,
    ResolvedMesh,
    Topology,
    build_config,
    load_config,
    mesh_axes,
    parse_override,
    preset_raw,
    presets,
)
from trainer.model.checks import resolve


def tiny_raw() -> dict:
    return preset_raw("tiny")


def tiny(*overrides: str):
    return build_config(tiny_raw(), overrides)


def one_slice(devices: int) -> Topology:
    return Topology(num_slices=1, devices_per_slice=devices, num_processes=1)


def test_presets_load_and_resolve_on_typical_topologies():
    def sizes(values):  # the built-in axes, whatever axes a fork adds
        return tuple(values[AXES.index(axis)] for axis in BUILTIN_MESH_AXES)

    tiny_mesh = resolve(load_config("tiny"), one_slice(8))
    AXES = tiny_mesh.axes
    assert sizes(tiny_mesh.shape) == (1, 1, 8, 1)  # pipeline first
    default = load_config("default")
    resolved = resolve(default, Topology(num_slices=2, devices_per_slice=4, num_processes=2))
    assert sizes(resolved.ici) == (1, 1, 4, 1) and sizes(resolved.dcn) == (1, 2, 1, 1)


def test_overrides_are_parsed_as_toml_scalars():
    config = tiny("optim.learning_rate=3e-4", "mesh.ici_tensor=2", "model.dtype=bfloat16",
                  "model.tie_embeddings=false")
    assert config.optim.learning_rate == 3e-4
    assert config.mesh.ici_tensor == 2
    assert config.model.dtype == "bfloat16"
    assert config.model.tie_embeddings is False
    assert parse_override("train.seed = 7") == ("train", "seed", 7)


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError, match=r"mesh\.ici_fdsp \(did you mean mesh\.ici_fsdp\?\)"
                                          r".*allowed keys in \[mesh\]: ici_data"):
        tiny("mesh.ici_fdsp=2")


def test_unknown_section_lists_sections():
    with pytest.raises(ConfigError, match=r"unknown section 'modle'.*model, mesh, train"):
        tiny("modle.d_model=3")


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        tiny("d_model=3")


def test_wrong_type_names_the_expected_type():
    with pytest.raises(ConfigError, match=r"model\.n_layers = 'two': expected int"):
        tiny("model.n_layers='two'")


@pytest.mark.parametrize(("typed", "shown"), [("true", "true"), ("1.5", "1.5"), ("TRUE", "TRUE"),
                                              ("2e0", "2e0")])
def test_a_wrong_type_shows_the_value_as_the_user_typed_it(typed, shown):
    with pytest.raises(ConfigError) as err:
        tiny(f"model.n_layers={typed}")
    assert str(err.value) == f"model.n_layers = {shown}: expected int"


def test_missing_key_is_an_error():
    raw = tiny_raw()
    del raw["train"]["seed"]
    with pytest.raises(ConfigError, match=r"\[train\] is missing seed; every key has its "
                                          r"default in .*base\.toml"):
        build_config(raw)


def test_base_declares_every_key_and_presets_only_their_changes():
    base = tomllib.loads((CONFIG_DIR / "base.toml").read_text())
    assert set(base) == set(SECTIONS)
    for section, cls in SECTIONS.items():
        # model.settings: a variant's own keys, declared where it registers (model/registry.py)
        declared = {f.name for f in dataclasses.fields(cls)} - {"extra", "settings"}
        if section == "mesh":  # and the keys of any axis a fork adds (config.MESH_AXES)
            declared |= {f"{group}_{axis}" for group in ("ici", "dcn") for axis in mesh_axes()}
        assert set(base[section]) == declared, section
    for name in presets():
        raw = tomllib.loads((CONFIG_DIR / f"{name}.toml").read_text())
        for section, values in raw.items():
            if section != "extends":  # the preset it builds on
                assert set(values) <= set(base[section]), (name, section)
        load_config(name)  # every preset is valid on its own
    assert tomllib.loads((CONFIG_DIR / "tiny.toml").read_text()).get("eval") is None
    assert load_config("tiny").eval.num_batches == base["eval"]["num_batches"]


def test_a_preset_file_outside_configs_is_laid_over_base(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("[model]\nd_model = 128\nn_heads = 2\n")
    config = load_config(str(path))
    base = load_config("base")
    assert config.model.d_model == 128 and config.model.n_layers == base.model.n_layers


@pytest.mark.parametrize(("override", "message"), [
    ("optim.learning_rate=nan", r"optim\.learning_rate = nan: must be a finite number > 0"),
    ("optim.learning_rate=inf", r"optim\.learning_rate = inf: must be a finite number > 0"),
    ("optim.learning_rate=-1e-3", r"optim\.learning_rate = -0\.001"),
    ("optim.b2=1.0", r"optim\.b2 = 1\.0: must be in \[0\.0, 1\.0\)"),
    ("optim.b1=-0.1", r"optim\.b1 = -0\.1: must be in \[0\.0, 1\.0\)"),
    ("optim.eps=0", r"optim\.eps = 0\.0: must be a finite number > 0"),
    ("optim.weight_decay=inf", r"optim\.weight_decay = inf: must be a finite number >= 0"),
    ("optim.grad_clip_norm=nan", r"optim\.grad_clip_norm = nan"),
    ("optim.min_lr_ratio=nan", r"optim\.min_lr_ratio = nan: must be in \[0\.0, 1\.0\]"),
    ("model.rope_theta=0", r"model\.rope_theta = 0\.0: must be a finite number > 0"),
    ("model.attention=flash", r"model\.attention = 'flash': allowed dense, dot_product, splash"),
    ("model.remat=some", r"model\.remat = 'some': allowed none, full, save_matmuls"),
    ("model.mlp=relu", r"model\.mlp = 'relu': allowed gelu, swiglu"),
    ("model.n_kv_heads=3", r"model\.n_heads = 4 is not a multiple of model\.n_kv_heads = 3"),
    ("model.loss_chunk_size=24", r"seq_len = 64 is not divisible by model\.loss_chunk_size = 24"),
    ("model.attention=splash", r"'splash' needs model\.seq_len divisible by 128, got 64"),
    ("train.grad_accum_steps=0", r"train\.grad_accum_steps = 0: must be > 0"),
    ("train.grad_accum_steps=3", r"global_batch_size = 16 is not divisible by "
                                 r"train\.grad_accum_steps = 3"),
    ("eval.num_batches=-1", r"eval\.num_batches = -1: must be >= 0"),
])
def test_out_of_range_values_are_rejected_before_anything_runs(override, message):
    with pytest.raises(ConfigError, match=message):
        tiny(override)


def test_accumulation_must_leave_whole_rows_per_batch_shard():
    with pytest.raises(ConfigError, match=r"does not split into train\.grad_accum_steps = 4 "
                                          r"micro-batches .* multiple of 32"):
        resolve(tiny("train.grad_accum_steps=4"), one_slice(8))


def test_two_fill_ins_in_one_group_are_rejected():
    with pytest.raises(ConfigError, match="at most one ici axis may be -1.*ici_data = -1, "
                                          "ici_fsdp = -1"):
        tiny("mesh.ici_data=-1")


def test_zero_parallelism_is_rejected():
    with pytest.raises(ConfigError, match=r"mesh\.dcn_fsdp = 0"):
        tiny("mesh.dcn_fsdp=0")


def test_ici_product_must_equal_devices_per_slice():
    config = tiny("mesh.ici_fsdp=4", "mesh.ici_tensor=2")
    with pytest.raises(ConfigError, match=r"ici_data\*ici_fsdp\*ici_tensor = 8 but each slice "
                                          r"has 4 devices"):
        resolve(config, one_slice(4))


def test_dcn_product_must_equal_slice_count():
    config = tiny("mesh.dcn_data=2")
    with pytest.raises(ConfigError, match=r"dcn_data\*dcn_fsdp\*dcn_tensor = 2 but the job "
                                          r"has 3 slices"):
        resolve(config, Topology(num_slices=3, devices_per_slice=1, num_processes=3))


def test_fill_in_that_cannot_divide_prints_numbers():
    config = tiny("mesh.ici_tensor=3")
    with pytest.raises(ConfigError, match="8 devices are not divisible by 3"):
        resolve(config, one_slice(8))


def test_dcn_tensor_warns_about_slow_dcn():
    config = tiny("mesh.dcn_data=1", "mesh.dcn_tensor=-1")
    with pytest.warns(UserWarning, match="dcn_tensor = 2"):
        resolve(config, Topology(num_slices=2, devices_per_slice=4, num_processes=2))


def test_global_batch_must_divide_over_batch_shards():
    config = tiny("train.global_batch_size=12")
    with pytest.raises(ConfigError, match=r"global_batch_size = 12 is not divisible by the 8 "
                                          r"batch shards"):
        resolve(config, one_slice(8))


def test_data_inside_slices_with_fsdp_across_them_is_allowed():
    resolved = resolve(tiny("mesh.ici_data=2", "mesh.ici_fsdp=-1", "mesh.dcn_data=1",
                            "mesh.dcn_fsdp=2"),
                       Topology(num_slices=2, devices_per_slice=4, num_processes=2))
    assert resolved == ResolvedMesh(ici=(1, 2, 2, 1), dcn=(1, 1, 2, 1))


def test_per_process_batch_must_be_integer():
    config = tiny("train.global_batch_size=4", "mesh.ici_fsdp=1", "mesh.ici_tensor=-1",
                  "mesh.dcn_data=1", "mesh.dcn_tensor=-1", "model.d_ff=192", "model.n_heads=2")
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="not divisible by the 3 "
                                                                      "processes"):
        resolve(config, Topology(num_slices=3, devices_per_slice=2, num_processes=3))


def test_model_dims_must_divide_over_tensor_and_fsdp():
    with pytest.raises(ConfigError, match="d_model = 64 is not divisible by model.n_heads = 6"):
        tiny("model.n_heads=6")
    with pytest.raises(ConfigError, match=r"model.n_heads \(or model.n_kv_heads\) = 4 is not "
                                          r"divisible by the tensor parallelism 8 \(tensor 8 = "
                                          r"ici_tensor 8 \* dcn_tensor 1\): parameter "
                                          r"blocks.attn.wk_DxGxK splits its dimension 2 "
                                          r"\(logical axis 'heads'\)"):
        resolve(tiny("mesh.ici_fsdp=1", "mesh.ici_tensor=-1"), one_slice(8))
    config = tiny("model.d_ff=198", "mesh.ici_fsdp=1", "mesh.ici_tensor=4", "mesh.ici_data=-1")
    with pytest.raises(ConfigError, match="d_ff = 198 is not divisible by the tensor "
                                          "parallelism 4"):
        resolve(config, one_slice(8))


def test_warmup_must_be_shorter_than_horizon():
    with pytest.raises(ConfigError, match=r"warmup_steps = 200 must be in \[0, "
                                          r"train.total_steps = 200\)"):
        tiny("optim.warmup_steps=200")


def test_missing_preset_lists_presets():
    with pytest.raises(ConfigError, match="use a preset.*default.*tiny"):
        load_config("huge")


def test_config_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny().train.seed = 3  # type: ignore[misc]


def test_data_checkpoint_and_profile_sections_are_validated():
    assert tiny().data.path == "" and tiny().profile.num_steps == 0  # profiling off by default
    with pytest.raises(ConfigError, match=r"data\.worker_count = -1: must be >= 0"):
        tiny("data.worker_count=-1")
    with pytest.raises(ConfigError, match=r"checkpoint\.save_interval_steps = 0: must be > 0"):
        tiny("checkpoint.save_interval_steps=0")
    assert tiny().checkpoint.local_every == 0  # the local tier is off unless asked for
    with pytest.raises(ConfigError, match=r"checkpoint\.local_every = -1: must be >= 0 \(steps "
                                          r"between saves to host-local storage; 0 = off\)"):
        tiny("checkpoint.local_every=-1")
    with pytest.raises(ConfigError, match=r"checkpoint\.local_max_to_keep = 0: must be > 0"):
        tiny("checkpoint.local_max_to_keep=0")
    with pytest.raises(ConfigError, match=r"profile\.start_step = 0: must be >= 1"):
        tiny("profile.num_steps=2", "profile.start_step=0")
    with pytest.raises(ConfigError, match=r"data\.prepare_if_missing = 'yes': expected bool"):
        tiny("data.prepare_if_missing='yes'")


def test_a_preset_file_of_megabytes_is_refused_by_its_size(tmp_path):
    huge = tmp_path / "huge.toml"
    with huge.open("wb") as out:
        out.truncate(2 << 20)  # sparse: nothing is written or read
    with pytest.raises(ConfigError, match=r"huge\.toml: 2,097,152 bytes; a config is at most"):
        load_config(str(huge))


def test_a_preset_extends_another_and_overrides_only_what_it_names(tmp_path):
    variant = tmp_path / "variant.toml"
    variant.write_text('extends = "tiny"\n[model]\nd_model = 32\n[train]\nseed = 7\n')
    config, base = load_config(str(variant)), load_config("tiny")
    assert (config.model.d_model, config.train.seed) == (32, 7)
    assert dataclasses.replace(config, model=dataclasses.replace(config.model, d_model=64),
                               train=dataclasses.replace(config.train, seed=base.train.seed)
                               ) == base
    # A chain, a path relative to the preset that names it: the nearest preset wins.
    (tmp_path / "deeper.toml").write_text('extends = "variant.toml"\n[model]\nn_layers = 3\n')
    deeper = load_config(str(tmp_path / "deeper.toml"))
    assert (deeper.model.d_model, deeper.model.n_layers, deeper.train.seed) == (32, 3, 7)


def test_a_preset_that_extends_in_a_loop_or_an_unknown_preset_is_refused(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(ConfigError, match=r"a\.toml: presets extend each other in a loop "
                                          r"\(a -> b -> a\)"):
        load_config(str(tmp_path / "a.toml"))
    (tmp_path / "c.toml").write_text('extends = "nosuch"\n')
    with pytest.raises(ConfigError, match=r"c\.toml: extends = 'nosuch': config 'nosuch' not "
                                          r"found at .*nosuch\.toml; use a preset \(.*tiny"):
        load_config(str(tmp_path / "c.toml"))
    (tmp_path / "d.toml").write_text("extends = 3\n")
    with pytest.raises(ConfigError, match=r"d\.toml: extends = 3: expected the name of a preset"):
        load_config(str(tmp_path / "d.toml"))
