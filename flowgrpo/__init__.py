"""flowgrpo: online RL (GRPO) for flow-matching image/video generators and causal language models."""

__version__ = "0.1.0"
