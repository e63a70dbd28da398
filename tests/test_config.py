"""Flag validation and the policy registry (no server)."""

from __future__ import annotations

import re

import pytest

from sglang_kvx.config import KvxConfigError, build_config, flag_choices, model_traits
from sglang_kvx.policies import POLICIES, KVPolicy, policy_names, register_policy


def test_defaults_are_plain_sglang():
    config = build_config()
    assert config.policy == "none" and config.keep_fraction == 1.0
    assert not config.enabled


@pytest.mark.parametrize("raw", ["0", "0.0", "-0.5", "1.5", "nan", "abc", ""])
def test_keep_fraction_outside_unit_interval_is_refused(raw):
    with pytest.raises(KvxConfigError, match=r"\(0, 1\]"):
        build_config("none", raw)


@pytest.mark.parametrize("raw,value", [("1", 1.0), ("0.1", 0.1), ("1e-3", 0.001)])
def test_keep_fraction_accepts_the_unit_interval(raw, value):
    assert build_config("knorm", raw).keep_fraction == value


@pytest.mark.parametrize("flags", [{"keep_fraction": "0.3"}, {"protected_prefix_len": "8"}, {"min_store_fraction": "0.5"},
                                   {"auto_context_min_tokens": "64"}, {"estimator": "/tmp"}])
def test_a_flag_for_an_idle_extension_is_refused(flags):
    """Without a policy, decode steps or sparse attention nothing of the extension runs: a setting
    for it would silently do nothing, so the launcher says so."""
    (name, raw), = flags.items()
    with pytest.raises(KvxConfigError, match=f"--kvx-{name.replace('_', '-')} has no effect"):
        build_config("none", **flags)
    build_config("none", decode_steps="on", **flags)  # with decode steps on, a request's policy reads them


def test_unknown_policy_names_the_valid_choices():
    with pytest.raises(KvxConfigError) as err:
        build_config("snapkvv")
    message = str(err.value)
    # The choices come from the registry alone: every registered policy, none of them listed here.
    assert message == "unknown --kvx-policy 'snapkvv'; valid choices: " + ", ".join(flag_choices())


def test_registered_but_unserved_policy_is_refused_not_ignored(monkeypatch):
    # Accepting a compacting policy the server cannot apply would silently serve the full cache.
    class OfflineOnly(KVPolicy):
        name = "_test_offline_only"
        served = False  # the policy's own fact: it scores offline only

    monkeypatch.setitem(POLICIES, OfflineOnly.name, OfflineOnly)
    with pytest.raises(KvxConfigError, match=re.escape("--kvx-policy _test_offline_only is not served yet (it scores offline)")):
        build_config(OfflineOnly.name, 0.5)


def test_every_shipped_policy_is_served():
    assert set(policy_names()) == set(flag_choices())


def test_gatesight_without_estimators_for_the_model_is_refused(tmp_path, demo_paths):
    from sglang_kvx.models.demo import weights_root

    # The 4-layer ancestor is a hybrid too, but no estimator was trained for it.
    with pytest.raises(KvxConfigError, match="no GateSight estimator was trained for"):
        build_config("gatesight", 0.5, model_path=str(weights_root() / "tiny-hybrid"), estimator="")
    build_config("gatesight", 0.5, model_path=demo_paths["tiny-hybrid-deep"])  # the shipped estimators fit it
    with pytest.raises(KvxConfigError, match="holds no GateSight estimator"):
        build_config("gatesight", 0.5, model_path=demo_paths["tiny-hybrid-deep"], estimator=str(tmp_path))


def test_gatesight_needs_a_hybrid_model(demo_paths):
    with pytest.raises(KvxConfigError, match="needs gdn, output_gate"):
        build_config("gatesight", 0.5, model_path=demo_paths["tiny-llama"])


def test_model_traits_from_config(demo_paths):
    hybrid = model_traits(demo_paths["tiny-hybrid-deep"])
    dense = model_traits(demo_paths["tiny-llama"])
    assert hybrid.has_gdn and hybrid.has_output_gate and hybrid.num_attention_layers == 2
    assert not dense.has_gdn and not dense.has_output_gate and dense.num_attention_layers == 4
    assert hybrid.num_kv_heads == dense.num_kv_heads == 2
    assert model_traits("/nonexistent/model") is None


def test_policy_the_model_cannot_serve_is_refused(demo_paths, monkeypatch):
    class NeedsGDN(KVPolicy):
        name = "_test_needs_gdn"
        needs = frozenset({"gdn"})

    monkeypatch.setitem(POLICIES, NeedsGDN.name, NeedsGDN)  # registered for this test only
    build_config("_test_needs_gdn", 0.5, demo_paths["tiny-hybrid-deep"])  # the hybrid has GDN signals
    with pytest.raises(KvxConfigError, match="needs gdn.*LlamaForCausalLM"):
        build_config("_test_needs_gdn", 0.5, demo_paths["tiny-llama"])


def test_registering_a_name_twice_fails():
    with pytest.raises(ValueError, match="already registered"):
        register_policy("none")(type("Dup", (KVPolicy,), {}))
