"""Reinforcement-learning helpers built on roving's processes (needs ``gymnasium``: ``pip install
roving[examples]``)."""
from .vector_env import RovingVectorEnv

__all__ = ["RovingVectorEnv"]
