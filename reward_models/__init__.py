"""Rewards: a registry of named rewards, ``load_reward`` to build one from a spec, ``MultiReward``
to combine several, and a remote client/server. The registry checks the reward names of a config
(``check_reward_names``) and says what a spec's components will be (``declared_components``)."""
from .base import REGISTRY, RewardModel, register_reward
from .ensemble import declared_components
from .loading import ManagedReward, available_rewards, check_reward_names, load_reward
from .multi import MultiReward

__all__ = ["REGISTRY", "RewardModel", "register_reward", "load_reward", "available_rewards",
           "check_reward_names", "declared_components", "MultiReward", "ManagedReward"]
