"""One spelling for each routing policy: `phalanx serve --policy`, `phalanx sim serve --policy`, the router
process, the benchmark's cases and the demo's table name the same policies (hedging included), and every
--help says what each does."""

from __future__ import annotations

import argparse

import pytest

from phalanx.bench.serving_tail import SLOW_CASES
from phalanx.cli.main import build_parser
from phalanx.core.errors import ConfigError
from phalanx.serve import router_main
from phalanx.serve.cluster import router_config
from phalanx.serve.demo import POLICIES as DEMO_POLICIES
from phalanx.serve.routing_policy import POLICY_NAMES, Policy, parse_policy

NAMES = ["round-robin", "p2c-queue", "p2c-latency", "p2c-latency+hedge"]


def _policy_action(parser: argparse.ArgumentParser, *path: str) -> argparse.Action:
    for name in path:  # walk down the subcommands
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return next(a for a in parser._actions if "--policy" in a.option_strings)


def _router_main_action() -> argparse.Action:
    captured: dict[str, argparse.ArgumentParser] = {}
    real = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *a: object, **kw: object) -> argparse.Namespace:
        captured["p"] = self
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        with pytest.raises(SystemExit):
            router_main.main([])
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
    return next(a for a in captured["p"]._actions if "--policy" in a.option_strings)


def test_serve_sim_serve_and_the_router_name_the_same_policies_and_say_what_each_does():
    assert list(POLICY_NAMES) == NAMES
    serve = _policy_action(build_parser(), "serve")
    sim = _policy_action(build_parser(), "sim", "serve")
    router = _router_main_action()
    assert list(serve.choices) == list(router.choices) == NAMES
    assert list(sim.choices) == ["all", *NAMES]
    for action in (serve, sim, router):
        for name in NAMES:
            assert f"{name}: " in action.help  # each policy explained, by its own name
        action.help % {}  # a stray % in a help text crashes --help: this raises if one is left unescaped


def test_each_name_means_one_choice_and_hedging_and_the_router_config_follows_it():
    assert parse_policy("p2c-latency+hedge") == (Policy.P2C_LATENCY, True)
    assert parse_policy("round-robin") == (Policy.ROUND_ROBIN, False)
    cfg = router_config("p2c-latency+hedge", False)
    assert cfg.hedging and cfg.policy.policy is Policy.P2C_LATENCY
    assert router_config("p2c-queue", True).hedging  # --hedging adds hedging to any policy
    with pytest.raises(ConfigError, match="known: round-robin, p2c-queue"):
        router_config("p2c+hedge", False)


def test_the_benchmark_and_the_demo_use_the_same_spellings():
    for name, policy, hedging, _ in SLOW_CASES:
        label = policy + ("+hedge" if hedging else "")
        assert parse_policy(label) == (Policy(policy), hedging)
        assert name in ("healthy", label) or name.startswith(label + ", ")  # "round-robin, no moves" is round-robin
    for name, policy, hedging in DEMO_POLICIES:
        assert name == policy + ("+hedge" if hedging else "") and name in POLICY_NAMES
