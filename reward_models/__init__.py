"""Rewards: a registry of named rewards, ``load_reward`` to build one from a spec, ``MultiReward``
to combine several, and a remote client/server."""
from .base import REGISTRY, RewardModel, register_reward
from .loading import ManagedReward, available_rewards, load_reward
from .multi import MultiReward

__all__ = ["REGISTRY", "RewardModel", "register_reward", "load_reward", "available_rewards",
           "MultiReward", "ManagedReward"]
