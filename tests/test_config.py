"""How config values are read (core/config_values.py, core/config.py): `--set` text and YAML files into each field's
type, and what is refused at load with a one-line ConfigError (tests/test_cli_errors.py tries the same through the
real CLI)."""
import pytest

from core import config as C


# ---- text settings keep their text ----------------------------------------------------------------------------
@pytest.mark.parametrize("key,text", [
    ("actor.judge_mode", "off"), ("envd.auth_token", "0x1F"), ("envd.auth_token", "0755"), ("envd.auth_token", "{x}"),
    ("envd.auth_token", "#abc"), ("envd.auth_token", "*abc"), ("name", "1.10"), ("name", "[oops"), ("name", "yes"),
    ("name", "null"), ("sft.demonstrator", "noisy:0.5"),
])
def test_a_set_text_value_is_kept_as_written(key, text):
    sets = [f"{key}={text}"] + (["control.auth_token=c"] if key.endswith("auth_token") else [])
    node = C.load(None, None, sets)
    for part in key.split("."):
        node = getattr(node, part)
    assert node == text and type(node) is str


def test_a_set_value_of_another_type_is_still_yaml():
    cfg = C.load(None, None, ["learner.lr=1e-4", "actor.env_ids=[builtin/click, builtin/menu]", "learner.archive=on",
                              "actor.env_options={a: 1}", "actor.env_ids=builtin/click,builtin/menu"])
    assert cfg.learner.lr == 1e-4 and cfg.learner.archive is True and cfg.actor.env_options == {"a": 1}
    assert cfg.actor.env_ids == ["builtin/click", "builtin/menu"]
    assert C.load(None, None, ["envd.auth_token=", "control.auth_token="]).envd.auth_token == ""


def test_a_set_entry_of_a_mapping_setting_is_read_as_the_mapping_would_be(tmp_path):
    """`--set actor.chat_template_kwargs.enable_thinking=false` kept the text "false" (a template's `enable_thinking
    is false` is then untrue: Qwen3 went on thinking) where `...kwargs={enable_thinking: false}` gives False; and the
    text left in the mapping made C.save (config.yaml of `tars up`) fail with a yaml RepresenterError."""
    sets = ["actor.chat_template_kwargs.enable_thinking=false", "actor.env_options.strict_targets=1",
            "actor.env_options.note=", "actor.env_options.deep.x=[1, 2]"]
    cfg = C.load("quickstart", None, sets)
    assert cfg.actor.chat_template_kwargs == C.load(None, None, ["actor.chat_template_kwargs={enable_thinking: false}"]
                                                    ).actor.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.actor.env_options == {"strict_targets": 1, "note": "", "deep": {"x": [1, 2]}}
    assert all(type(k) is str for k in cfg.actor.env_options)
    C.save(cfg, tmp_path / "c.yaml")
    assert C.load(None, str(tmp_path / "c.yaml")) == cfg
    with pytest.raises(C.ConfigError, match="actor.env_options.bad"):
        C.load(None, None, ["actor.env_options.bad=[oops"])


@pytest.mark.parametrize("text,shown", [("actor:\n  judge_mode: off", "actor.judge_mode: YAML read this value as the "
                                        "boolean False"), ("model:\n  path: 0755", "model.path: YAML read this value as "
                                        "the number 493"), ("name: 0x1F", "name: YAML read this value as the number 31"),
                                        ("model:\n  path: {x}", "the mapping"), ("name: #x", "an empty (null) value")])
def test_a_yaml_file_text_setting_of_another_type_says_to_quote_it(tmp_path, text, shown):
    (tmp_path / "c.yaml").write_text(text + "\n")
    with pytest.raises(C.ConfigError, match="quote the value as written") as e:
        C.load(None, str(tmp_path / "c.yaml"))
    assert shown in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "q.yaml").write_text('actor:\n  judge_mode: "off"\nmodel:\n  path: \'0755\'\n')
    cfg = C.load(None, str(tmp_path / "q.yaml"))
    assert (cfg.actor.judge_mode, cfg.model.path) == ("off", "0755")


@pytest.mark.parametrize("text,key", [
    ("learner:\n  lr: 0.5\nactor:\n  concurrency: 8\nlearner:\n  batch_size: 8\n", "'learner' given twice in one "
     "mapping (line 5)"),
    ("learner:\n  lr: 0.5\n  lr: 0.25\n", "'lr' given twice in one mapping (line 3)"),
])
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, text, key):
    """PyYAML keeps the last of two equal keys silently: a second `learner:` section dropped the first one's
    lr=0.5, and the run trained at the default 1e-3 without a word."""
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(C.ConfigError, match="cannot be read as YAML") as e:
        C.load(None, str(tmp_path / "c.yaml"))
    assert key in str(e.value) and "\n" not in str(e.value)
    assert C.load_yaml("a: &x {b: 1}\nc:\n  <<: *x\n  b: 2\n")["c"] == {"b": 2}  # a merge key may be overridden


def test_a_saved_config_reads_back_the_same(tmp_path):
    """config.yaml of a run (C.save) quotes text that YAML would read as another type, so it loads unchanged."""
    cfg = C.load("quickstart", None, ["actor.judge_mode=off", "envd.auth_token=0755", "control.auth_token=0x1F",
                                      "name=1.10"])
    C.save(cfg, tmp_path / "c.yaml")
    assert C.load(None, str(tmp_path / "c.yaml")) == cfg


# ---- ports -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["learner.stream.port=65536", "envd.port=-1", "inference.port=70000",
                                     "inference.sglang_base_port=70000"])
def test_every_port_setting_is_a_tcp_port(setting):
    with pytest.raises(C.ConfigError, match=r"must be in \[-?[01], 65535\]"):
        C.load(None, None, [setting])
    with pytest.raises(C.ConfigError, match="last server's port 65536 is past 65535"):
        C.load(None, None, ["inference.sglang_launch=2", "inference.sglang_base_port=65535"])


def test_command_options_are_config_settings_checked_at_load():
    """`tars envd --port`, `tars serve --port/--engine/--sglang-launch/--sglang-url` go through the config checks."""
    from tars.cli import _load, build_parser

    a = build_parser().parse_args(["serve", "--model", "m", "--port", "5", "--engine", "sglang", "--sglang-url",
                                   "http://a:1", "--sglang-url", "http://b:2", "--sglang-launch", "0"])
    inf = _load(a).inference
    assert (inf.port, inf.engine, inf.sglang_urls, inf.sglang_launch) == (5, "sglang", ["http://a:1", "http://b:2"], 0)
    assert _load(build_parser().parse_args(["envd", "--port", "7"])).envd.port == 7
    for argv in (["envd", "--port", "70000"], ["envd", "--port", "-1"], ["serve", "--model", "m", "--port", "70001"]):
        with pytest.raises(C.ConfigError, match=r"port = -?\d+: must be in \[0, 65535\]"):
            _load(build_parser().parse_args(argv))


# ---- a --set value that is not YAML --------------------------------------------------------------------------------
@pytest.mark.parametrize("setting,needle", [("actor.env_ids=[oops", "actor.env_ids: '[oops' is not a valid YAML value"),
                                            ("learner.lr=*x", "learner.lr: '*x' is not a valid YAML value"),
                                            ("actor.env_options={a", "actor.env_options: '{a' is not a valid YAML"),
                                            ("learner.batch_size=.inf", "learner.batch_size: inf is not int")])
def test_a_set_value_that_cannot_be_read_is_a_config_error(setting, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, None, [setting])
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- choice settings are checked at load ----------------------------------------------------------------------------
@pytest.mark.parametrize("key,bad,allowed", [
    ("learner.algo", "PPO", "ppo | grpo"), ("actor.on_parse_error", "Stop", "continue | stop"),
    ("actor.judge_mode", "False", "off | replace | add"), ("actor.judge_on_error", "drop", "infra_error | env"),
    ("actor.system_prompt", "computre", "auto | tiny | none | computer | browser | mobile"),
    ("actor.coordinates", "pixels", "auto | absolute | relative | screen"),
    ("actor.on_context_full", "wrap", "window | truncate"), ("inference.engine", "vllm", "local | sglang"),
    ("learner.stream.durability", "none", "wal | checkpoint"), ("learner.stream.wal_writer", "proc", "process | thread"),
    ("inference.sglang_pause_mode", "pause", "abort | retract | in_place"),
])
def test_a_choice_setting_outside_its_choices_is_refused_at_load(tmp_path, key, bad, allowed):
    """learner.algo=PPO trained GRPO without a critic, actor.on_parse_error=Stop went on; the actor's own checks of
    judge_mode, system_prompt, coordinates and judge_on_error ran only after `tars up` had started (and its SFT)."""
    with pytest.raises(C.ConfigError, match=f"^{key} = '{bad}': must be one of {allowed}$".replace("|", r"\|")):
        C.load(None, None, [f"{key}={bad}"])
    section, _, name = key.rpartition(".")
    (tmp_path / "c.yaml").write_text("".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(section.split(".")))
                                     + f"{'  ' * (section.count('.') + 1)}{name}: '{bad}'\n")
    with pytest.raises(C.ConfigError, match="must be one of"):
        C.load(None, str(tmp_path / "c.yaml"))
    for good in allowed.split(" | "):
        C.load(None, None, [f"{key}={good}", "envd.auth_token=", "inference.sglang_urls=[]"])


def test_learner_config_error_names_the_algorithms():
    """PPOTrainer raises LearnerConfig.config_error() for a config built in code, past the loader's checks."""
    assert "learner.algo: 'PPO' is not one of ppo | grpo" == C.LearnerConfig(algo="PPO").config_error()


def test_the_actors_choices_are_the_configs():
    """The actor keeps its own checks (core cannot import the actor): the two lists must agree."""
    import dataclasses

    from actor.tiny import SYSTEM_PROMPTS
    from actor.uitars import COORDINATES

    fields = {fl.name: fl.metadata.get("choices") for fl in dataclasses.fields(C.ActorConfig)}
    assert set(fields["system_prompt"]) == set(SYSTEM_PROMPTS) and set(fields["coordinates"]) == set(COORDINATES)


# ---- bounds and finite numbers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting,needle", [
    ("actor.retries=-1", "actor.retries = -1: must be >= 0"),  # every envd call returned None
    ("learner.checkpoint.every=0", "learner.checkpoint.every = 0: must be >= 1"),  # ZeroDivisionError after update 1
    ("learner.ppo.epochs=0", "learner.ppo.epochs = 0: must be >= 1"),
    ("learner.group.size=0", "learner.group.size = 0: must be >= 1"),
    ("actor.send_window=0", "actor.send_window = 0: must be >= 1"),
    ("learner.lr=nan", "learner.lr = nan: must be a finite number"),  # NaN passes lo=0
    ("telemetry.sample_ratio=nan", "telemetry.sample_ratio = nan: must be a finite number"),  # and lo=0, hi=1
    ("actor.temperature=.inf", "actor.temperature = inf: must be a finite number"),
    ("learner.ppo.gamma=-.inf", "learner.ppo.gamma = -inf: must be a finite number"),
])
def test_values_outside_what_the_code_can_run_are_refused_at_load(tmp_path, setting, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, None, [setting])
    assert str(e.value) == needle
    key, _, value = setting.partition("=")
    *section, name = key.split(".")
    (tmp_path / "c.yaml").write_text("".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(section))
                                     + f"{'  ' * len(section)}{name}: {value}\n")
    with pytest.raises(C.ConfigError, match="must be"):
        C.load(None, str(tmp_path / "c.yaml"))
    assert C.load(None, None, ["actor.retries=0", "learner.checkpoint.every=1"]).actor.retries == 0


# ---- booleans are not numbers, numbers are not booleans ---------------------------------------------------------------
def _yaml_setting(tmp_path, setting: str) -> str:
    """`a.b=v` as a YAML file with v unquoted, its path."""
    key, _, value = setting.partition("=")
    *section, name = key.split(".")
    (tmp_path / "c.yaml").write_text("".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(section))
                                     + f"{'  ' * len(section)}{name}: {value}\n")
    return str(tmp_path / "c.yaml")


@pytest.mark.parametrize("setting,needle", [
    ("actors=true", "actors: True is a boolean, not int"),  # loaded as 1 actor before
    ("actor.concurrency=true", "actor.concurrency: True is a boolean, not int"),
    ("learner.batch_size=false", "learner.batch_size: False is a boolean, not int"),
    ("learner.lr=false", "learner.lr: False is a boolean, not float"),  # loaded as lr 0.0 before
    ("learner.ppo.gamma=yes", "learner.ppo.gamma: True is a boolean, not float"),  # YAML 1.1: yes is true
    ("telemetry.sample_ratio=on", "telemetry.sample_ratio: True is a boolean, not float"),
])
def test_a_boolean_for_a_number_setting_is_refused(tmp_path, setting, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, None, [setting])
    assert str(e.value) == needle
    with pytest.raises(C.ConfigError) as e:
        C.load(None, _yaml_setting(tmp_path, setting))
    assert str(e.value) == needle


@pytest.mark.parametrize("value", ["2", "-1", "0.5", "1.0", "[1]", "{a: 1}", "[]"])
def test_a_bool_setting_takes_only_booleans_and_0_or_1(tmp_path, value):
    """`bool(value)` made learner.archive=2, [1] or {a: 1} true and [] false."""
    needle = "learner.archive: {} is not a boolean (true | false, or 0 | 1)"
    import yaml

    shown = repr(yaml.safe_load(value))
    with pytest.raises(C.ConfigError) as e:
        C.load(None, None, [f"learner.archive={value}"])
    assert str(e.value) == needle.format(shown)
    with pytest.raises(C.ConfigError) as e:
        C.load(None, _yaml_setting(tmp_path, f"learner.archive={value}"))
    assert str(e.value) == needle.format(shown)


@pytest.mark.parametrize("value,want", [("1", True), ("0", False), ("true", True), ("false", False), ("on", True),
                                        ("no", False), ('"yes"', True), ('"off"', False)])
def test_a_bool_setting_still_takes_booleans_and_0_1(tmp_path, value, want):
    assert C.load(None, _yaml_setting(tmp_path, f"learner.archive={value}")).learner.archive is want
    if not value.startswith('"'):
        assert C.load(None, None, [f"learner.archive={value}"]).learner.archive is want


# ---- bounds of the settings that had none -----------------------------------------------------------------------------
@pytest.mark.parametrize("setting,needle", [
    ("inference.max_queue=0", "inference.max_queue = 0: must be >= 1"),  # every request RESOURCE_EXHAUSTED
    ("inference.threads=0", "inference.threads = 0: must be >= 1"),
    ("inference.cache_block_tokens=0", "inference.cache_block_tokens = 0: must be >= 1"),
    ("inference.cache_max_bytes=-1", "inference.cache_max_bytes = -1: must be >= 0"),  # 0 = auto stays legal
    ("inference.update_timeout_s=0", "inference.update_timeout_s = 0.0: must be > 0"),
    ("inference.sglang_health_interval_s=0", "inference.sglang_health_interval_s = 0.0: must be > 0"),  # busy loop
    ("envd.lease_ttl_s=0", "envd.lease_ttl_s = 0.0: must be > 0"),  # the heartbeat sleeps lease_ttl_s / 3
    ("envd.gc_interval_s=-1", "envd.gc_interval_s = -1.0: must be > 0"),
    ("envd.step_timeout_s=0", "envd.step_timeout_s = 0.0: must be > 0"),
    ("envd.max_sessions=0", "envd.max_sessions = 0: must be >= 1"),
    ("envd.max_sessions_per_client=-1", "envd.max_sessions_per_client = -1: must be >= 0"),
    ("actor.rpc_timeout_s=0", "actor.rpc_timeout_s = 0.0: must be > 0"),
    ("actor.image_history=-2", "actor.image_history = -2: must be >= -1"),  # -1 = auto stays legal
    ("learner.ppo.gamma=1.5", "learner.ppo.gamma = 1.5: must be in [0, 1]"),
    ("learner.ppo.lam_policy=-0.1", "learner.ppo.lam_policy = -0.1: must be in [0, 1]"),
    ("learner.ppo.eps_low=-0.2", "learner.ppo.eps_low = -0.2: must be >= 0"),
    ("learner.ppo.behav_cap=0", "learner.ppo.behav_cap = 0.0: must be > 0"),  # log(0) in the clamp
    ("learner.ppo.minibatches=0", "learner.ppo.minibatches = 0: must be >= 1"),
    ("learner.correction.rho_bar=0", "learner.correction.rho_bar = 0.0: must be > 0"),
    ("learner.grad_clip=0", "learner.grad_clip = 0.0: must be > 0"),
    ("learner.stream.queue_size=0", "learner.stream.queue_size = 0: must be >= 1"),
    ("learner.publish.keep_versions=0", "learner.publish.keep_versions = 0: must be >= 1"),
    ("evaluation.temperature=-2", "evaluation.temperature = -2.0: must be >= -1"),
    ("model.rope_theta=0", "model.rope_theta = 0.0: must be > 0"),
])
def test_the_new_bounds_are_refused_with_their_message(tmp_path, setting, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, None, [setting])
    assert str(e.value) == needle
    with pytest.raises(C.ConfigError, match="must be"):
        C.load(None, _yaml_setting(tmp_path, setting))


@pytest.mark.parametrize("value", ["-0.5", "-1e-9"])
def test_an_evaluation_temperature_between_the_sentinel_and_0_is_refused(tmp_path, value):
    """evaluation.temperature takes -1 (= actor.temperature) or a temperature >= 0: -0.5 passed the field's bound
    (lo=-1) and tars/heldout.py silently used actor.temperature for it."""
    with pytest.raises(C.ConfigError, match=r"evaluation.temperature=-[0-9.e-]+: a sampling temperature >= 0, or -1"):
        C.load(None, None, [f"evaluation.temperature={value}"])
    assert C.load(None, None, ["evaluation.temperature=0"]).evaluation.temperature == 0


@pytest.mark.parametrize("setting", ["seed", "model.seed"])
def test_a_seed_torch_cannot_take_is_refused_at_load(setting):
    """torch.manual_seed takes -2**63 .. 2**64-1: a seed past it loaded, then failed deep in a role (the fresh model
    of `tars up`, the learner: "Overflow when unpacking long long", restarted until max_restarts)."""
    for bad in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(C.ConfigError, match=f"^{setting} = {bad}: must be in"):
            C.load(None, None, [f"{setting}={bad}"])
    for good in ((1 << 64) - 1, -(1 << 63)):
        assert C.load(None, None, [f"{setting}={good}"])


def test_documented_special_values_stay_legal():
    cfg = C.load(None, None, ["actor.image_history=-1", "evaluation.temperature=-1", "inference.cache_max_bytes=0",
                              "envd.max_total_pids=0", "envd.max_sessions_per_client=0", "inference.max_version_jump=0",
                              "inference.sticky_max_imbalance=0", "learner.ppo.truncated_value=-1",
                              "actor.format_penalty=-5", "seed=-3", "learner.ppo.gamma=0", "learner.ppo.gamma=1"])
    assert (cfg.actor.image_history, cfg.inference.cache_max_bytes, cfg.seed) == (-1, 0, -3)


def test_an_actor_can_run_a_whole_group():
    """An actor starts GRPO groups whole (actor/main.py Actor.run: free slots >= group size); with fewer slots than
    members it never started an episode and the run stalled without a word."""
    with pytest.raises(C.ConfigError, match="actor.concurrency=4 is below learner.group.size=8"):
        C.load(None, None, ["actor.concurrency=4", "learner.group.size=8"])
    assert C.load(None, None, ["actor.concurrency=8", "learner.group.size=8"]).learner.group.size == 8
    for preset in ("quickstart", "miniwob"):
        C.load(preset)


def test_the_outbox_holds_the_send_window():
    with pytest.raises(C.ConfigError, match="actor.max_outbox=8 is below actor.send_window=256"):
        C.load(None, None, ["actor.max_outbox=8"])
    assert C.load(None, None, ["actor.max_outbox=8", "actor.send_window=8"]).actor.max_outbox == 8


def test_every_default_passes_its_own_bounds():
    """A bound added later that its field's default breaks fails here, not in every `tars up`."""
    import dataclasses
    import typing

    from core.config_values import _check

    checked = []

    def walk(cls, pre=""):
        hints = typing.get_type_hints(cls)
        for fl in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[fl.name]):
                walk(hints[fl.name], pre + fl.name + ".")
            elif fl.default is not dataclasses.MISSING and {"lo", "hi", "choices"} & set(fl.metadata):
                _check(fl, fl.default, pre + fl.name)
                checked.append(pre + fl.name)

    walk(C.RunConfig)
    assert len(checked) > 100 and "learner.ppo.gamma" in checked and "envd.lease_ttl_s" in checked
    C.from_dict(C.RunConfig, {})


def test_help_shows_an_open_bound():
    assert "envd.lease_ttl_s = 60.0 (0..]" in C.help_text() and "learner.ppo.gamma = 1.0 [0..1]" in C.help_text()


def test_a_hint_policy_in_the_actors_env_options_is_refused():
    # envd's hint_policy makes every result carry a scripted baseline's next action: an eval baseline's, never a run's
    for policy in ("oracle", "random"):
        with pytest.raises(C.ConfigError, match=r"actor.env_options.hint_policy: .*tars eval --model oracle\|random"):
            C.load(None, None, [f"actor.env_options={{hint_policy: {policy}}}"])
    assert C.load(None, None, ["actor.env_options={strict_targets: 1}"]).actor.env_options == {"strict_targets": 1}
